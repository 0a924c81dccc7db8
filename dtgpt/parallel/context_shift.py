"""Multi-token prediction under context parallelism: a split sequence shifted one place left.

Each cp rank holds chunks r and 2cp-1-r of a sequence cut into 2cp (dtgpt.parallel.context).
Shifting the whole sequence left moves the first token of every chunk to the end of the chunk
before it, so each local chunk needs the first token of the next global chunk: held by another
rank, by this one (chunk cp follows chunk cp-1, both on rank cp-1), or, after the last chunk,
none (the fill value). One all-gather of every rank's two chunk heads gives each rank what it
needs: the shifted token ids, positions and labels equal the one-process ones exactly, as
Megatron's roll_tensor makes them with its point-to-point exchange (the same bytes at cp = 2).
The tensors shifted are integers that carry no gradient, so the functional all-gather needs no
backward.

The prediction loss also divides each depth's loss by its loss tokens in the micro-batch:
`total` sums the ranks' counts over cp (one all-reduce of a value per depth).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from dtgpt.mtp import SequenceShift
from dtgpt.parallel.collectives import all_gather


def next_chunk_holder(chunk: int, cp_size: int) -> tuple[int, int] | None:
    """(cp rank, slot 0 or 1 on that rank) holding the chunk after global chunk `chunk` of
    2 * cp_size; None after the last."""
    following = chunk + 1
    if following == 2 * cp_size:
        return None
    return (following, 0) if following < cp_size else (2 * cp_size - 1 - following, 1)


class ContextParallelShift(SequenceShift):
    def __init__(self, cp_mesh: DeviceMesh):
        self.cp_mesh = cp_mesh
        self.cp_rank = cp_mesh.get_local_rank()
        self.cp_size = cp_mesh.size()

    def __call__(self, t: torch.Tensor, fill: int) -> torch.Tensor:
        """(..., T_local) this rank's two chunks -> their part of the whole sequence shifted left."""
        chunks = t.chunk(2, dim=-1)
        gathered = self.gather(torch.stack([chunk[..., 0] for chunk in chunks]))  # heads (2, ...)
        shifted = []
        for slot, chunk in enumerate(chunks):
            rolled = chunk.roll(-1, dims=-1)
            global_chunk = self.cp_rank if slot == 0 else 2 * self.cp_size - 1 - self.cp_rank
            holder = next_chunk_holder(global_chunk, self.cp_size)
            rolled[..., -1] = fill if holder is None else gathered[2 * holder[0] + holder[1]]
            shifted.append(rolled)
        return torch.cat(shifted, dim=-1)

    def gather(self, heads: torch.Tensor) -> torch.Tensor:
        """(2, ...) -> (2 * cp, ...): rank q's heads at 2q (its first chunk) and 2q + 1 (its second)."""
        return all_gather(heads.contiguous(), gather_dim=0, group=self.cp_mesh)

    def total(self, counts: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(counts, "sum", group=self.cp_mesh)
