"""Megatron's vocabulary-parallel cross-entropy, on each tp rank's block of the vocabulary.

Under loss parallelism the column-parallel head leaves the logits a DTensor sharded over the
vocabulary (Shard(-1)). torch's `loss_parallel()` computes the loss from it through DTensor's
dispatch: `python scripts/bench_loss_ops.py --tp 2` counted 187 aten ops for a bf16 micro-batch
(the plain one-process loss: 29), among them the fp32 cast through DTensor, three all-reduces
behind functional-collective wrappers, and in backward an `index_put_` whose CPU kernel reads
three scalars back to the host. Here the loss is Megatron's algorithm as one autograd function
on the local shard (DTensor stays at the boundary: its `to_local()` gives the shard and, in
backward, takes its gradient back as Shard(-1)):

    forward   m = max over the block, all-reduced (MAX)
              t = the target's logit where the label falls in this block, else 0 (a gather on
                  clamped indices times a mask: nothing data-dependent reaches the host)
              s = sum of exp(logit - m) over the block
              (s, t) all-reduced (SUM) as one stacked tensor: Megatron's two all-reduces of
                  b·s fp32 in one of 2·b·s, the same bytes, one launch fewer
              loss = log s - (t - m)
    backward  (softmax - one-hot of the target) on the block, times the incoming gradient;
              no collective.

Computed in fp32 (Megatron upcasts inside its vocabulary-parallel loss whatever the logits'
dtype; here the subtraction of m promotes, so no fp32 copy of the logits is made first); with training.fp16_lm_cross_entropy the token losses are rounded to the logits' dtype,
as the one-process low-precision loss returns them. Labels equal to IGNORE_INDEX count 0 and
get no gradient, as `cross_entropy_sum` skips them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from dtgpt.data.batch import IGNORE_INDEX


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, first: int, group: dist.ProcessGroup) -> torch.Tensor:
        # logits (N, V/tp) this rank's block, whose first vocabulary id is `first`; labels (N,)
        top = logits.amax(dim=-1).float()  # a maximum is exact in any dtype
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)  # (N, V/tp) fp32 by type promotion: no cast copy of the logits
        local = labels - first
        inside = (local >= 0) & (local < shifted.shape[-1])  # IGNORE_INDEX (< 0) is inside no block
        index = local.clamp(0, shifted.shape[-1] - 1).unsqueeze(-1)
        target = shifted.gather(-1, index).squeeze(-1) * inside
        sums = torch.stack((shifted.exp().sum(dim=-1), target))
        dist.all_reduce(sums, group=group)
        log_sum = sums[0].log()
        kept = labels != IGNORE_INDEX
        losses = (log_sum - sums[1]) * kept
        # exp(logit - m - log s), as one process's log-softmax has it (bitwise equal to its
        # gradient for most elements; Megatron's exp(logit - m) / s for few): saved for backward.
        softmax = shifted.sub_(log_sum.unsqueeze(-1)).exp_()
        ctx.save_for_backward(softmax, index, inside, kept)
        ctx.dtype = logits.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        softmax, index, inside, kept = ctx.saved_tensors
        grad = softmax.scatter_add_(-1, index, -inside.unsqueeze(-1).to(softmax.dtype))  # in place, as Megatron
        grad = grad.mul_((grad_losses.float() * kept).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_losses(logits: DTensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token losses (fp32, 0 where the label is IGNORE_INDEX), a plain tensor of labels'
    shape, from logits sharded Shard(-1) over a 1-D tp mesh (equal blocks: tp divides the padded
    vocabulary)."""
    mesh = logits.device_mesh
    if mesh.ndim != 1 or logits.placements[0] != Shard(logits.ndim - 1):
        raise ValueError(f"vocab-parallel cross-entropy takes logits sharded over the vocabulary on a 1-D mesh, not {logits.placements} on {mesh}")
    local = logits.to_local()
    block = local.shape[-1]
    first = mesh.get_local_rank() * block
    losses = _VocabParallelCrossEntropy.apply(local.reshape(-1, block), labels.flatten(), first, mesh.get_group())
    return losses.view_as(labels)


def vocab_parallel_cross_entropy_sum(logits: DTensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses in fp32, skipping IGNORE_INDEX: `cross_entropy_sum` on sharded logits."""
    return vocab_parallel_losses(logits, labels).sum()


def low_precision_vocab_parallel_cross_entropy_sum(logits: DTensor, labels: torch.Tensor) -> torch.Tensor:
    """As `low_precision_cross_entropy_sum`: each token's loss in the logits' dtype, summed in fp32."""
    return vocab_parallel_losses(logits, labels).to(logits.dtype).float().sum()


def vocab_parallel_loss(in_fp32: bool) -> Callable[[DTensor, torch.Tensor], torch.Tensor]:
    return vocab_parallel_cross_entropy_sum if in_fp32 else low_precision_vocab_parallel_cross_entropy_sum
