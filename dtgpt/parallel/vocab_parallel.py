"""Megatron's vocabulary-parallel word embedding as a DTensor parallel style.

Each tp rank holds a contiguous block of vocabulary rows (the weight is Shard(0)). A rank looks
up the ids that fall in its block, zeroes the rows of the others, and the partial outputs are
summed over tp by DTensor's redistribute (an all-reduce to Replicate, a reduce-scatter to a
sequence shard). Backward gives each rank the gradient of its own rows only.

Why not torch's RowwiseParallel on nn.Embedding: its forward is the same (masked lookup, partial
output), but DTensor has no sharding rule that computes embedding_dense_backward for a row-sharded
weight from a replicated output gradient, so it picks the replicated one: every rank runs the
whole vocabulary's backward and holds a (vocab, hidden) gradient beside its (vocab/tp, hidden)
shard. Here the lookup runs on local tensors, so autograd records the mask and the local
backward is the shard's, and the only collective is still DTensor's own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle


class VocabParallelEmbedding(ParallelStyle):
    """An nn.Embedding sharded over the vocabulary; takes plain ids, returns a plain tensor laid
    out as `output_layouts` (Replicate, or Shard(1) for a sequence-parallel region)."""

    def __init__(self, *, output_layouts: Placement = Replicate()):
        super().__init__()
        self.output_layouts = output_layouts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding shards an nn.Embedding, not {type(module).__name__}")
        weight = distribute_tensor(module.weight, device_mesh, [Shard(0)])
        module.register_parameter("weight", nn.Parameter(weight, module.weight.requires_grad))
        module.forward = functools.partial(_lookup, module, device_mesh, self.output_layouts)
        return module


def _lookup(module: nn.Embedding, mesh: DeviceMesh, output_layout: Placement, ids: torch.Tensor) -> torch.Tensor:
    # The parameter is read at call time: FSDP puts its gathered (tp-sharded) weight there.
    local = module.weight.to_local()  # its gradient comes back as Shard(0): this rank's rows only
    rows = local.shape[0]  # tp divides the padded vocabulary (config.padded_vocabulary)
    first = mesh.get_local_rank() * rows
    outside = (ids < first) | (ids >= first + rows)
    out = F.embedding((ids - first).masked_fill(outside, 0), local)  # (B, T, C)
    # Recorded by autograd: the ids of other ranks' rows add nothing to row 0's gradient.
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [output_layout]).to_local()
