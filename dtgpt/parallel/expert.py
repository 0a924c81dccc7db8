"""Expert parallelism: each MoE layer's experts split over the `ep` ranks, tokens sent to them.

The ep ranks are folded out of the data-parallel shard x cp ranks (Megatron's parallel folding;
dtgpt.parallel.dims builds the `ep` and `efsdp` meshes), so EP needs no extra ranks: every rank
still holds the whole attention and dense MLPs, and 1/ep of each layer's experts. `apply_ep`
makes each stacked expert parameter a DTensor sharded on its leading (expert) axis over ep
(replicated over tp, whose ranks each route their own sequence chunk) and hands the layer an
AllToAllDispatcher over the ep group. FSDP then shards the experts' parameters over the ranks
that remain, `efsdp` (dtgpt.parallel.fsdp), and everything else over dp_shard x cp as before.

The parameters keep their full (global) shapes as DTensors, so the seeded full-shape
initialisation and the checkpoints are the same at every ep (DESIGN invariants 1 and 3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dtgpt.model import GPT
from dtgpt.moe.dispatch import AllToAllDispatcher
from dtgpt.moe.stats import moe_layers


def apply_ep(model: GPT, ep_mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None) -> None:
    """Shard every MoE layer's experts over `ep_mesh` (expert e on ep rank e // (E / ep)) and
    route its tokens there and back.

    expert_mesh: the mesh the expert parameters live on, ep alone or (ep, tp) (unless tp folds
    into their FSDP shards, ParallelDims.expert_mesh); None: ep_mesh.
    """
    expert_mesh = expert_mesh or ep_mesh
    placements = [Shard(0)] + [Replicate()] * (expert_mesh.ndim - 1)
    group = ep_mesh.get_group()
    for layer in moe_layers([model]).values():
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            full = param.data.to_local() if isinstance(param, DTensor) else param.data  # replicated over tp: whole
            # src_data_rank=None: each rank takes its own chunk (the values are drawn later, on the full shape).
            sharded = distribute_tensor(full, expert_mesh, placements, src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.dispatcher = AllToAllDispatcher(experts.num_experts, group)


def apply_moe_sequence_ranks(model: GPT, sequence_mesh: DeviceMesh) -> None:
    """Where each rank holds a chunk of every sequence (cp, tp under SP: `sequence_mesh`), the
    router's losses count the experts' loads over the whole sequences, each rank its share."""
    group = sequence_mesh.get_group()

    def sum_over_sequence(counts: torch.Tensor) -> torch.Tensor:
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=group)
        return counts

    for layer in moe_layers([model]).values():
        layer.router.sequence_ranks = sequence_mesh.size()
        layer.router.sum_over_sequence_ranks = sum_over_sequence

