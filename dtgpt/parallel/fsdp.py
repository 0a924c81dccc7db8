"""Data parallelism with FSDP2 `fully_shard` (HSDP on a 2-D mesh), and the precision regime.

Megatron's regime for fp16/bf16: the model computes in the low-precision dtype (every
parameter gathered in it, so the residual stream, each norm's output, every tensor- and
context-parallel collective and every pipeline send move two bytes per element), over fp32
master weights that the optimizer steps; gradients come out of backward in the compute dtype and
are accumulated and reduced in fp32 (`training.accumulate_allreduce_grads_in_fp32`, always on
under bf16 unless `training.grad_reduce_in_bf16`: then in bf16, as Megatron's --grad-reduce-in-bf16). FSDP's MixedPrecisionPolicy is exactly that, so a low-precision run is FSDP-sharded
wherever ranks share weights (dp x cp > 1); where none does (one process, tp or pp at dp x cp =
1) the same regime runs through a compute copy of the masters instead
(dtgpt/parallel/compute_copy.py: FSDP's numbers, without its per-unit hooks), an MoE model
excepted: the regime never depends on dp. Norms compute their statistics in fp32 inside the op (dtgpt.norms.LayerNorm and
RMSNorm return the compute dtype even from an fp32 residual stream), softmax
in fp32 inside attention, the loss in fp32 (dtgpt.parallel.model_parts).

Each block is one FSDP unit (its parameters are gathered just before it runs); the embedding
and norm+head get units of their own unless the model ties them, in which case the shared
weight stays with the root unit, the only module that holds both users of it. Under expert
parallelism each MoE layer's experts are a unit of their own inside their block's, sharded over
the dp ranks that remain once ep is folded out (`expert_mesh`, dtgpt/parallel/expert.py), on
their second axis: the first is already split over ep, and two splits of one axis would make
FSDP's strided placements (_StridedShard) out of plain shards.

Under tp with FSDP the MoE layers fold tp into their FSDP mesh (`moe_mesh`, ParallelDims.
tp_folds_into_moe), as Megatron folds it into its expert-data-parallel group: each MoE layer is
a unit of its own over dp_shard x cp x tp holding its router (and, without ep, its experts), so
the gradients every tp rank holds a partial sum of are summed over dp and tp in that unit's one
reduce-scatter, not all-reduced over tp one parameter at a time. Its shared expert, sharded over
tp as a dense MLP, is a unit of its own over the dp ranks.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from dtgpt.model import GPT
from dtgpt.moe.stats import moe_layers


def mixed_precision_policy(compute: torch.dtype | None, reduce: torch.dtype) -> MixedPrecisionPolicy:
    """Gather in the compute dtype (None: fp32 as stored); accumulate and reduce in `reduce`."""
    # Inputs are left as they come: the model decides its dtypes (fp32_residual_connection).
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, cast_forward_inputs=False)


def apply_fsdp(
    model: GPT,
    dp_mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    *,
    reshard_after_forward: bool,
    expert_mesh: DeviceMesh | None = None,
    moe_mesh: DeviceMesh | None = None,
) -> None:
    """expert_mesh: under expert parallelism, the mesh that shards the (ep-sharded) experts;
    moe_mesh: where tp folds in, the mesh of each MoE layer's unit (module docstring)."""

    def shard(module, mesh=dp_mesh):
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)

    if expert_mesh is not None:
        for layer in moe_layers([model]).values():
            fully_shard(layer.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=lambda _param: Shard(1))  # fmt: skip
    if moe_mesh is not None:
        for layer in moe_layers([model]).values():
            if layer.shared_expert is not None:
                shard(layer.shared_expert)
            shard(layer, moe_mesh)
    for block in model.layers.values():
        shard(block)
    tied_here = model.tied and model.embedding is not None and model.output is not None
    if not tied_here:
        if model.embedding is not None:
            shard(model.embedding)
        head = [m for m in (model.norm, model.output) if m is not None]
        if head:
            fully_shard(head, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root unit holds what is left (the tied weight); its forward ends the step anyway.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)


_SYNC_SET = "_micro_batch_sync"  # on the root: the (last, reshard) state set_micro_batch_sync left its units in


def set_micro_batch_sync(model: torch.nn.Module, *, last: bool, reshard_every_micro_batch: bool) -> None:
    """Before one micro-batch's backward: reduce-scatter gradients only after the last one.

    Earlier micro-batches accumulate unsharded gradients locally (in the reduce dtype), so each
    unit's gradients cross the network once per iteration (as Megatron's distributed optimizer
    reduces them), and its gathered parameters stay for the next micro-batch unless memory asks
    for resharding. torch.distributed.pipelining's stage does the same for FSDP stages itself.

    Only a change is set: each setter walks every module of the part (about 0.5 to 3 ms a call
    at 12 layers on a loaded CPU), and the state changes twice per iteration at most (before
    the first of several micro-batches and before the last), never with one micro-batch. The
    state left is recorded on the module itself, so a rebuilt model starts from FSDP's default
    (the last micro-batch's: every setter True).
    """
    if not isinstance(model, FSDPModule):
        return
    wanted = (last, last or reshard_every_micro_batch)
    if getattr(model, _SYNC_SET, (True, True)) == wanted:
        return
    setattr(model, _SYNC_SET, None)  # unknown until every setter has run
    model.set_is_last_backward(last)
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(wanted[1])
    setattr(model, _SYNC_SET, wanted)
