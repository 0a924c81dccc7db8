"""Pending gradient sums (DTensor's Partial over tp) reduced in one bucket, not one at a time.

Without FSDP, the parameters tp replicates but each tp rank computes on its own tokens (norm
weights under sequence parallelism, qk-norms, an MoE layer's router and experts) come out of
backward holding partial sums over tp. Redistributing each gradient alone costs an all-reduce
per parameter; Megatron sums them in one coalesced all-reduce, and so does this: every pending
gradient of one mesh, placement and dtype is copied into one flat buffer, all-reduced once per
partial mesh dimension, and handed back as views of it. (Under FSDP, its post-backward sums
them: the MoE layers in their units' reduce-scatters, ParallelDims.tp_folds_into_moe.)
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _pending(grad: torch.Tensor | None) -> bool:
    return isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements)


@torch.no_grad()
def reduce_pending_grads_bucketed(params: list[torch.nn.Parameter], reduce_dtype: torch.dtype | None = None) -> int:
    """Sum every Partial gradient of `params` in one all-reduce per (mesh, placements, dtype)
    and partial dimension, leaving each as Replicate there. Returns the number of buckets.

    reduce_dtype: what the sum crosses ranks in where it differs from the gradients' (a compute
    copy's fp32 masters under fp16 without accumulate_allreduce_grads_in_fp32 sum in fp16, as
    FSDP and Megatron do there)."""
    buckets: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if _pending(grad):
            buckets[(grad.device_mesh, tuple(grad.placements), grad.dtype)].append(param)
    for (mesh, placements, _dtype), members in buckets.items():
        locals_ = [p.grad._local_tensor for p in members]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        message = flat if reduce_dtype in (None, flat.dtype) else flat.to(reduce_dtype)
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                if placement.reduce_op != "sum":
                    raise RuntimeError(f"a pending gradient reduces by {placement.reduce_op!r}: only sums are bucketed")
                dist.all_reduce(message, group=mesh.get_group(dim))
        if message is not flat:
            flat.copy_(message)
        summed = tuple(Replicate() if p.is_partial() else p for p in placements)
        offset = 0
        for param, local in zip(members, locals_):
            view = flat[offset : offset + local.numel()].view(local.shape)
            offset += local.numel()
            grad = param.grad
            param.grad = DTensor.from_local(view, mesh, summed, run_check=False, shape=grad.shape, stride=grad.stride())
    return len(buckets)
