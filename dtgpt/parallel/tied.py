"""Tied word embedding and output head across pipeline stages (and the word embedding that
multi-token prediction uses on the last stage, which Megatron ties to the first stage's the same way).

With pp > 1 the first stage holds the embedding and the last the head, each as its own
parameter. Both start equal (same init), and their gradients are summed every step, so the
optimizer moves them identically: they stay one weight, as in a one-process run. Since that
rests on every step syncing, `check_tied_copies` verifies it cheaply (one all-reduce of a shard
between two ranks, every log_interval): the copies must be bitwise equal.

No stock collective covers "the first and last pipeline stage only", so this file builds that
process group (one per (dp, tp) coordinate) and all-reduces the local gradient shards over it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtgpt.model import GPT
from dtgpt.parallel.dims import ParallelDims


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def shares_embedding(part: GPT) -> bool:
    """Whether the last stage uses the word embedding too: a tied head, or multi-token prediction
    (which embeds tokens there, Megatron's shared embedding)."""
    return part.tied or part.cfg.mtp_depth > 0


def _last_stage_copy(part: GPT) -> torch.Tensor | None:
    if part.embedding is not None and not part.embeds_input:  # multi-token prediction's copy (maybe the head too)
        return part.embedding.word.weight
    if part.tied and part.output is not None and part.embedding is None:
        return part.output.weight
    return None


def tied_pair_on_rank(parts: list[GPT]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(first-stage embedding weight, last stage's copy of it) held by this rank, when the last
    stage uses the embedding and pipelining split them; (None, None) otherwise."""
    if not shares_embedding(parts[0]):
        return None, None
    first = next((p.embedding.word.weight for p in parts if p.embedding is not None and p.embeds_input), None)
    last = next((w for p in parts if (w := _last_stage_copy(p)) is not None), None)
    return first, last


def build_tied_group(dims: ParallelDims, parts: list[GPT], ends_on_one_rank: bool) -> dist.ProcessGroup | None:
    """The group {first pp rank, last pp rank} containing this rank, or None when not needed:
    without pipelining, an untied model, or when one rank holds both ends (V-shaped schedules).

    Every rank must call this (new_group is collective), even ranks that hold neither end.
    """
    if not dims.pp_enabled or not shares_embedding(parts[0]) or dims.mesh is None or ends_on_one_rank:
        return None
    ranks = dims.mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp)
    first, last = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
    if first == last:
        return None
    mine = None
    for a, b in zip(first, last):
        group = dist.new_group([a, b])
        if dist.get_rank() in (a, b):
            mine = group
    return mine


def align_grad_placement(param: torch.Tensor) -> None:
    """Give a DTensor gradient its parameter's placements.

    The vocabulary-parallel embedding's backward returns a *replicated* full-size gradient for
    a Shard(0) weight; the head's gradient is Shard(0). Both ends must hold the same shard
    before their gradients are summed (going from replicated to sharded needs no comm).
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


@torch.no_grad()
def sync_tied_grads(parts: list[GPT], group: dist.ProcessGroup | None, reduce_dtype: torch.dtype = torch.float32) -> None:
    """Sum the gradients of the split tied weight so both copies take the same step; across
    ranks in reduce_dtype (the dtype gradients are reduced in: fp16 for an fp16 run without
    accumulate_allreduce_grads_in_fp32, as Megatron's embedding-gradient all-reduce)."""
    if not shares_embedding(parts[0]):
        return
    first, last = tied_pair_on_rank(parts)
    for param in (first, last):
        if param is not None and param.grad is not None:
            align_grad_placement(param)
    if first is not None and last is not None:  # V-shaped schedules: both ends on this rank
        total = _local(first.grad) + _local(last.grad)
        _local(first.grad).copy_(total)
        _local(last.grad).copy_(total)
        return
    held = first if first is not None else last
    if held is not None and group is not None:
        grad = _local(held.grad)
        message = grad if grad.dtype == reduce_dtype else grad.to(reduce_dtype)
        dist.all_reduce(message, group=group)
        if message is not grad:
            grad.copy_(message)


@torch.no_grad()
def check_tied_copies(parts: list[GPT], group: dist.ProcessGroup | None, iteration: int) -> None:
    """Raise if this rank's shard of the split tied weight differs between first and last stage.

    The first stage's rank contributes its shard, the last stage's rank its negation: their sum
    is exactly zero when the copies are equal. Ranks holding neither copy do nothing.
    """
    first, last = tied_pair_on_rank(parts)
    if first is not None and last is not None:
        difference = _local(first) - _local(last)
    elif (first is not None or last is not None) and group is not None:
        difference = _local(first).clone() if first is not None else -_local(last)
        dist.all_reduce(difference, group=group)
    else:
        return
    worst = difference.abs().max().item()
    if worst != 0.0:
        raise RuntimeError(
            f"iteration {iteration}: the first and last pipeline stages' copies of the tied word embedding "
            f"differ by up to {worst:.3e}: their gradients were not summed every step"
        )
