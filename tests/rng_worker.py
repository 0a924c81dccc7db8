"""Dropout masks of a tp2 model, for tests/test_rng.py: run under torchrun with 2 ranks.

Each rank saves to OUT/rank<r>.pt, for sequence parallelism off and on, the keep-masks that
every dropout drew in one training forward ("draw 1"), the masks of the next forward ("draw 2"),
and those of a fresh model that loaded a checkpoint saved between the two ("after load").
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import dtgpt
from dtgpt.model import CoreAttention, Dropout

MODEL = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
    hidden_dropout=0.5, attention_dropout=0.5, make_vocab_size_divisible_by=64,
)  # fmt: skip
DATA = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128, num_workers=0)


def config(sequence_parallel: bool):
    return dtgpt.make_config(
        model=MODEL,
        data=DATA,
        training=dict(micro_batch_size=4, global_batch_size=4, train_iters=2),
        parallel=dict(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel),
    )


def attention_mask(core: CoreAttention, heads: int, seq: int) -> torch.Tensor:
    """The keep-mask of attention dropout: with q = k = 0 every allowed score is equal and
    v = identity puts the weight of key j in output channel j, so a zero marks a dropped weight."""
    q = torch.zeros(4, heads, seq, seq)
    v = torch.eye(seq).expand(4, heads, seq, seq)
    out = core(q, q, v)
    return (out != 0)[..., torch.tril(torch.ones(seq, seq, dtype=torch.bool))]


def draw(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> keep-mask of every dropout in one training forward, then of each attention core."""
    part, masks, hooks = model.parts[0], {}, []
    for name, module in part.named_modules():
        if isinstance(module, Dropout):
            hooks.append(module.register_forward_hook(lambda m, i, o, name=name: masks.setdefault(name, []).append(o != 0)))
    part(tokens)
    for h in hooks:
        h.remove()
    masks = {name: torch.cat([m.flatten() for m in drawn]) for name, drawn in masks.items()}
    for name, module in part.named_modules():
        if isinstance(module, CoreAttention):
            masks[name] = attention_mask(module, heads=2, seq=MODEL["seq_length"])  # 4 heads / tp 2
    return masks


def main(out: Path) -> None:
    runtime = dtgpt.init_distributed(config(False))
    tokens = torch.randint(0, 128, (4, MODEL["seq_length"]), generator=torch.Generator().manual_seed(0))
    result = {}
    for sp in (False, True):
        cfg = config(sp)
        state = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, vocab_size=128))
        state.model.train()
        first = draw(state.model, tokens)
        state.progress.iteration = 1
        dtgpt.save_checkpoint(out / f"ckpt_sp{int(sp)}", cfg, runtime, state)
        second = draw(state.model, tokens)
        fresh = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, vocab_size=128))
        fresh.model.train()
        draw(fresh.model, tokens)  # move both streams on: the load must put them back
        dtgpt.load_checkpoint(out / f"ckpt_sp{int(sp)}", cfg, runtime, fresh)
        result[f"sp{int(sp)}"] = {"draw 1": first, "draw 2": second, "after load": draw(fresh.model, tokens)}
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dtgpt.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
