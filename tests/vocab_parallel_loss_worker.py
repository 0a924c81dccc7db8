"""On 2 gloo ranks: dtgpt's vocabulary-parallel cross-entropy against megatron-core's and one process's.

    torchrun --nproc-per-node 2 tests/vocab_parallel_loss_worker.py OUT

Every rank builds the same (4, 8, 64) logits and labels (some IGNORE_INDEX, others in both
ranks' vocabulary blocks), takes its block of the vocabulary, and computes per-token losses and
the gradient of its block three ways: dtgpt's function on the DTensor shard, megatron-core's
`vocab_parallel_cross_entropy` on the local block (parallel_state at tp=2), and F.cross_entropy
on the whole logits in one process. The host reads dispatched during dtgpt's forward and backward
are counted. Rank r writes OUT/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.data.batch import IGNORE_INDEX  # noqa: E402
from dtgpt.parallel.vocab_parallel_loss import vocab_parallel_losses  # noqa: E402

SHAPE, VOCAB = (4, 8), 64


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (a sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.item, torch.ops.aten._local_scalar_dense):
            self.count += 1
        return func(*args, **(kwargs or {}))


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(*SHAPE, VOCAB, generator=g)).to(dtype)
    labels = torch.randint(0, VOCAB, SHAPE, generator=g)
    labels[0, :4] = IGNORE_INDEX
    labels[1, 0], labels[1, 1] = 0, VOCAB - 1  # the first and last ids of the two blocks
    labels[1, 2], labels[1, 3] = VOCAB // 2 - 1, VOCAB // 2
    weights = torch.rand(SHAPE, generator=g)  # the incoming gradient of each token's loss
    return logits, labels, weights


def run(dtype: torch.dtype, mesh, rank: int) -> dict:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, labels, weights = inputs(dtype)
    kept = labels != IGNORE_INDEX
    block = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
    out = {}

    sharded = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
    with HostReads() as reads:
        losses = vocab_parallel_losses(sharded, labels)
        (losses * weights).sum().backward()
    out["dtgpt"] = (losses.detach(), sharded.grad.to_local())
    out["host_reads"] = reads.count
    with HostReads() as reads:
        losses.sum().item()  # the counter does see a host read
    out["counter_sees"] = reads.count

    local = logits[..., block].clone().requires_grad_()
    # Megatron's loss has no ignored labels: it is compared where the label is kept, and its
    # gradient taken with the ignored tokens' weight 0.
    megatron = vocab_parallel_cross_entropy(local, labels.clamp(min=0))
    (megatron * weights * kept).sum().backward()
    out["megatron"] = (megatron.detach(), local.grad)

    whole = logits.clone().requires_grad_()
    plain = F.cross_entropy(whole.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    (plain.view(SHAPE) * weights).sum().backward()
    out["plain"] = (plain.detach().view(SHAPE), whole.grad[..., block])
    out["kept"] = kept
    return out


def main(out: Path) -> None:
    from megatron.core import parallel_state

    dist.init_process_group("gloo")
    try:
        parallel_state.initialize_model_parallel(2, 1)
        mesh = init_device_mesh("cpu", (2,))
        rank = dist.get_rank()
        results = {name: run(dtype, mesh, rank) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
