"""Data parallelism with FSDP2 `fully_shard` (HSDP on a 2-D mesh), and its mixed precision.

Mixed precision is one regime at every dp: fp32 parameters (the master weights), gathered and
reduced in fp32, with fp16/bf16 compute from `torch.autocast` (ModelParts.compute_context), as at
dp = 1 where there is no FSDP at all. FSDP's own param_dtype cast would make the regime depend on
dp: it casts *every* parameter (norm weights and the embedding table, so the residual stream
would be low precision), where autocast casts only matmul operands and runs norms and softmax in
fp32. The price, against a low-precision all-gather: fp32 gathers (twice the bytes) and a
2-byte cast of each weight that autograd keeps from forward to backward.

Each block is one FSDP unit (its parameters are gathered just before it runs); the embedding
and norm+head get units of their own unless the model ties them, in which case the shared
weight stays with the root unit, the only module that holds both users of it.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dtgpt.model import GPT


def mixed_precision_policy() -> MixedPrecisionPolicy:
    """fp32 gathers and fp32 gradient reduction; autocast does the low-precision compute (see above)."""
    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)


def apply_fsdp(
    model: GPT,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
) -> None:
    mp = mixed_precision_policy()

    def shard(module):
        fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)

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


def set_micro_batch_sync(model: torch.nn.Module, *, last: bool, reshard_every_micro_batch: bool) -> None:
    """Before one micro-batch's backward: reduce-scatter gradients only after the last one.

    Earlier micro-batches accumulate unsharded gradients locally, so each unit's gradients cross
    the network once per iteration (as Megatron's distributed optimizer reduces them), and its
    gathered parameters stay for the next micro-batch unless memory asks for resharding.
    torch.distributed.pipelining's stage does the same for FSDP stages itself.
    """
    if not isinstance(model, FSDPModule):
        return
    model.set_is_last_backward(last)
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last or reshard_every_micro_batch)
