"""What each of 4 dp_shard ranks creates and reads, for tests/test_rank_share.py (torchrun, 4 ranks).

Each rank writes OUT/rank<r>.json: the largest tensor it created while building the model (by a
dispatch mode that sees every op's output), the model's largest parameter, the bytes it read
while saving and while loading a checkpoint (/proc/self/io rchar: files and sockets), and whether
the loaded weights equal the saved ones, and which iteration a load took once a byte of rank 3's
file of the newer checkpoint changed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import dtgpt

VOCAB = 4096
MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=32, make_vocab_size_divisible_by=128)


def config():
    return dtgpt.make_config(
        model=MODEL,
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        training=dict(micro_batch_size=1, global_batch_size=4, train_iters=1),
        parallel=dict(data_parallel_shard_size=4),
    )


class LargestCreated(TorchDispatchMode):
    """The most elements of any plain tensor an op returns (a DTensor's local ops are seen too)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if type(t) is torch.Tensor and t.device.type != "meta" and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


def rchar() -> int:
    return int(next(line for line in open("/proc/self/io") if line.startswith("rchar")).split()[1])


def gathered(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.parts[0].named_parameters()}


def main(out: Path) -> None:
    cfg = config()
    runtime = dtgpt.init_distributed(cfg)
    with LargestCreated() as mode:
        model = dtgpt.build_model(cfg, runtime, vocab_size=VOCAB)
    record = {"largest_created": mode.largest, "largest_op": mode.op,
              "largest_param": max(math.prod(p.shape) for p in model.parts[0].parameters())}  # fmt: skip
    state = dtgpt.build_train_state(cfg, model)
    rows = torch.randint(0, VOCAB, (4, MODEL["seq_length"] + 1), generator=torch.Generator().manual_seed(0))
    dtgpt.train_step(cfg, state, rows.chunk(4)[dist.get_rank()])  # the AdamW state exists
    saved = gathered(model)
    dist.barrier()
    before = rchar()
    dtgpt.save_checkpoint(out / "ckpt", cfg, runtime, state)
    record["save_read"] = rchar() - before
    fresh = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, vocab_size=VOCAB))
    dist.barrier()
    before = rchar()
    dtgpt.load_checkpoint(out / "ckpt", cfg, runtime, fresh)
    record["load_read"] = rchar() - before
    loaded = gathered(fresh.model)
    record["loaded_equal"] = all(torch.equal(saved[n], loaded[n]) for n in saved)
    record["checkpoint_bytes"] = sum(p.stat().st_size for p in (out / "ckpt").rglob("*") if p.is_file())
    # Iteration 2 with a byte of rank 3's file changed: only rank 3 reads that file here, and
    # every rank must fall back to iteration 1 together.
    state.progress.iteration = 2
    dtgpt.save_checkpoint(out / "ckpt", cfg, runtime, state)
    if dist.get_rank() == 0:
        data = out / "ckpt" / "iter_0000002" / "__3_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    dist.barrier()
    again = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, vocab_size=VOCAB))
    record["after_damage"] = dtgpt.load_checkpoint(out / "ckpt", cfg, runtime, again)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dtgpt.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
