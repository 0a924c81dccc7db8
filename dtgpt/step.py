"""One training iteration: forward-backward over micro-batches, gradient sync and clip, optimizer.

`train_step` is the iteration on one page; `local_forward_backward` hides the difference between
one stage and a pipeline schedule, `forward_backward` adds the syncs a bare loop needs. The loss of
a global batch is the sum of its token losses over the number of loss tokens in the global
batch (DESIGN invariant 1), so gradients are sums over micro-batches and ranks, never means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtgpt.config import Config, num_microbatches
from dtgpt.config.batch_schedule import BatchSizeSchedule
from dtgpt.data.batch import Batch, build_batch, loss_tokens
from dtgpt.moe.stats import set_aux_loss_scale
from dtgpt.mtp import mtp_summary, with_mtp_shares
from dtgpt.parallel.context import split_sequence
from dtgpt.parallel.fsdp import set_micro_batch_sync
from dtgpt.parallel.model_parts import GlobalBatchLoss, ModelParts
from dtgpt.state import TrainState


def as_batch(batch: Batch | torch.Tensor) -> Batch:
    """A Batch as the loader builds it; (B, T+1) sample tokens as one with every option off."""
    return batch if isinstance(batch, Batch) else build_batch(batch)


def token_index(rows: int, seq_length: int, first_sample: int, device: torch.device) -> torch.Tensor:
    """(rows, seq_length): sample number * seq_length + position, for samples first_sample, ..."""
    samples = torch.arange(first_sample, first_sample + rows, device=device)
    return samples[:, None] * seq_length + torch.arange(seq_length, device=device)


def rank_batch(model: ModelParts, batch: Batch | torch.Tensor, first_sample: int = 0) -> Batch:
    """This rank's batch on its device: under context parallelism, its chunks of every sequence.

    Every per-token tensor (tokens, labels, positions, documents, token indices) is made on the
    full sequence first, then cut by the one split_sequence, so each cp rank holds its chunks with
    their global positions and every per-token option composes with cp. Token indices (where the
    model takes them) number this rank's samples from first_sample + dp_rank * rows: the loader's
    contiguous slice of the global batch that starts at sample first_sample.
    """
    batch = as_batch(batch).map(lambda t: t.to(model.device, non_blocking=True))
    dims = model.dims
    if model.token_index:
        rows, seq_length = batch.tokens.shape
        first = first_sample + dims.dp_rank * rows
        batch = replace(batch, token_index=token_index(rows, seq_length, first, model.device))
    if not dims.cp_enabled:
        return batch
    if batch.position_ids is None:
        batch = replace(batch, position_ids=torch.arange(batch.tokens.shape[1], device=model.device).expand_as(batch.tokens))
    return batch.map(lambda t: split_sequence(t, dims.cp_rank, dims.cp))


def global_batch_loss(model: ModelParts, labels: torch.Tensor, loss_scale: float) -> GlobalBatchLoss:
    """The loss of this global batch: its loss-token count is summed over dp x cp (each rank
    holds a share of the samples, each cp rank a share of their tokens)."""
    denominator = loss_tokens(labels)
    model.dims.all_reduce(denominator, ("dp_cp",))
    return GlobalBatchLoss(denominator, loss_scale, model.cross_entropy, mtp=model.mtp_loss)


def micro_batch_means(model: ModelParts, batch: Batch, loss_scale: float, num_microbatches: int) -> tuple[Batch, GlobalBatchLoss]:
    """Megatron's default loss (calculate_per_token_loss=false): the mean of the micro-batch
    means. Each micro-batch is divided by its own loss tokens, summed over cp so that every cp
    layout averages over whole sequences, and by the micro-batches of the global batch (times
    dp, whose ranks' losses are summed). The counts travel as a last label column."""
    counts = torch.stack([loss_tokens(chunk) for chunk in batch.labels.chunk(num_microbatches)])
    model.dims.all_reduce(counts, ("cp",))
    rows = batch.labels.shape[0] // num_microbatches
    column = counts.to(batch.labels.dtype).repeat_interleave(rows)[:, None]
    loss = GlobalBatchLoss(torch.tensor(float(num_microbatches * model.dims.dp), device=model.device), loss_scale,
                           model.cross_entropy, count_column=True, mtp=model.mtp_loss)  # fmt: skip
    return replace(batch, labels=torch.cat([batch.labels, column], dim=1)), loss


def local_forward_backward(
    model: ModelParts,
    batch: Batch | torch.Tensor | None,
    num_microbatches: int,
    *,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    first_sample: int = 0,
    per_token: bool = True,
) -> torch.Tensor:
    """Run this rank's share of a global batch (num_microbatches micro-batches) whose first
    sample is sample `first_sample` of the run (what layout-invariant dropout keys on).

    Returns this rank's part of the global-batch loss (unscaled), its micro-batch losses summed,
    and leaves gradients unsynced across pipeline stages (forward_backward does both). Under
    pipelining only ranks holding the last stage have a non-zero part, and a rank holding
    neither the first nor the last stage gets no batch (None) unless every stage takes the
    per-token inputs (position_ids, document_ids).
    """
    loss = None
    # The router losses' gradient: the LM loss's scale over the global batch's micro-batches.
    set_aux_loss_scale(model.parts, loss_scale / (num_microbatches * model.dims.dp))
    if model.reads_batches:
        batch = rank_batch(model, batch, first_sample)
    if model.has_last_stage:
        if per_token:
            loss = global_batch_loss(model, batch.labels, loss_scale)
        else:
            batch, loss = micro_batch_means(model, batch, loss_scale, num_microbatches)
    grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
    with grad_mode:
        total = _run(model, loss, batch, num_microbatches, forward_only)
    return total / loss_scale if loss_scale != 1.0 else total  # bf16 and fp32 have no loss scale


def _run(model: ModelParts, loss: GlobalBatchLoss | None, batch: Batch | None, num_microbatches: int, forward_only: bool) -> torch.Tensor:
    if model.schedules is not None:
        return _pipelined(model, loss, batch, num_microbatches, forward_only)
    return _one_stage(model, loss, batch, num_microbatches, forward_only)


@torch.no_grad()
def local_loss_sum(model: ModelParts, batch: Batch | torch.Tensor | None, num_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only over this rank's share of a global batch: (sum of its token losses, number of
    its loss tokens), both zero on a rank without the last pipeline stage."""
    if model.reads_batches:
        batch = rank_batch(model, batch)
    count, loss = torch.zeros((), device=model.device), None
    if model.has_last_stage:
        count = loss_tokens(batch.labels)
        loss = GlobalBatchLoss(torch.ones((), device=model.device), 1.0, model.cross_entropy)  # a plain sum
    return _run(model, loss, batch, num_microbatches, forward_only=True), count


def forward_backward(model: ModelParts, batch: Batch | torch.Tensor | None, num_microbatches: int, *, forward_only: bool = False) -> float:
    """Forward and backward over the micro-batches of one global batch (through the pipeline
    schedule when there is one); returns the global-batch loss, the same on every rank. The
    gradients of a tied embedding split across pipeline stages are summed, as train_step does."""
    local = local_forward_backward(model, batch, num_microbatches, forward_only=forward_only)
    if not forward_only:
        model.sync_tied_grads()
    return reduce_loss(model, local).item()


def _one_stage(model: ModelParts, loss: GlobalBatchLoss, batch: Batch, num_microbatches: int, forward_only: bool) -> torch.Tensor:
    total = None  # the first loss itself, not 0 + it: the same value, three ops fewer
    part = model.forward_module()
    for i, micro in enumerate(batch.chunk(num_microbatches)):
        micro_loss = loss(part(micro.tokens, **micro.model_inputs()), micro.labels)
        if not forward_only:
            last = i == num_microbatches - 1
            set_micro_batch_sync(part, last=last, reshard_every_micro_batch=model.fsdp_reshard_every_micro_batch)
            micro_loss.backward()
            model.after_backward(first=i == 0, last=last)
        total = micro_loss.detach() if total is None else total + micro_loss.detach()
    return total


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` with a fresh tensor's strides. torch 2.11's first stage checks every step's inputs
    against the strides it first saw; tokens are a view of the samples (one token longer), and
    .contiguous() keeps a one-sample batch's row stride (T + 1): a batch-size ramp-up from one
    sample then failed with a stride mismatch."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return t if t.stride() == tuple(strides) else t.clone(memory_format=torch.contiguous_format)


def _pipelined(model: ModelParts, loss: GlobalBatchLoss | None, batch: Batch | None, num_microbatches: int, forward_only: bool) -> torch.Tensor:
    args = (_dense(batch.tokens),) if model.has_first_stage else ()
    target = batch.labels if model.has_last_stage else None
    # The schedule cuts tensor keywords into micro-batches itself but would hand the document
    # bounds (host numbers, ragged per micro-batch) whole to each: they go to the stages cut here.
    inputs = {k: _dense(v) for k, v in replace(batch, document_bounds=None).model_inputs().items()} if batch is not None else {}
    bounds = batch.document_bounds.chunk(num_microbatches) if batch is not None and batch.document_bounds is not None else None
    if model.mtp_loss is not None and model.has_last_stage:
        inputs["input_ids"] = _dense(batch.tokens)  # the last stage's prediction modules embed them
    losses: list[torch.Tensor] | None = [] if model.has_last_stage else None
    model.refresh_compute_copies()
    model.schedules.run(num_microbatches, loss, forward_only, *args, target=target, losses=losses, return_outputs=False,
                        document_bounds=bounds, **inputs)  # fmt: skip
    if not losses:
        return torch.zeros((), device=model.device)
    return torch.stack([micro_loss.detach().float() for micro_loss in losses]).sum()


def reduce_loss(model: ModelParts, local_loss: torch.Tensor) -> torch.Tensor:
    """Sum the per-rank loss parts over dp x cp (and pp, where only the last stage is non-zero)."""
    return model.dims.all_reduce(local_loss.clone(), ("dp_cp", "pp"))


def counted_here(grad: torch.Tensor) -> bool:
    """Whether this rank counts `grad` toward the norm: every shard once, a replicated gradient
    only on the replica at coordinate 0 of each dimension it is replicated over."""
    if not isinstance(grad, DTensor):
        return True
    coordinate = grad.device_mesh.get_coordinate()
    for i, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise RuntimeError("a gradient is still a pending sum: reduce_pending_grads() comes before the norm")
        if placement.is_replicate() and coordinate[i] != 0:
            return False
    return True


@torch.no_grad()
def local_squared_grad_norm(model: ModelParts) -> torch.Tensor:
    """This rank's part of the squared L2 norm of all gradients (each shared weight counted once
    across tp, dp, cp and pp): summed over every rank, it is the global one. Non-finite whenever
    one of this rank's gradients is."""
    grads = (p.grad for p in model.norm_parameters())
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads if g is not None and counted_here(g)]
    if not local:
        return torch.zeros((), device=model.device)
    return torch.stack(torch._foreach_norm(local)).float().pow(2).sum()


def reduce_loss_and_norm(
    model: ModelParts, local_loss: torch.Tensor, squared_norm: torch.Tensor, routing: torch.Tensor | None = None
) -> torch.Tensor:
    """[global loss, global gradient norm, *summed MoE routing statistics] in one fp32 tensor,
    from one all-reduce over every rank: the scalars Megatron moves per iteration too (its norm
    and its overflow flag: here a non-finite norm is the overflow), and the routing statistics'
    vector (dtgpt/moe/stats.py) when there is one. tp ranks hold the same loss: only tp rank 0
    contributes it. One tensor, so that the host reads it in one go, with no stack to build."""
    dims = model.dims
    loss = local_loss.float() if dims.tp_rank == 0 else torch.zeros_like(local_loss, dtype=torch.float32)
    both = torch.stack([loss, squared_norm.to(loss.device)])
    if routing is not None:
        both = torch.cat([both, routing.to(both)])
    if dims.mesh is not None and dims.world_size > 1:
        dist.all_reduce(both)
    both[1:2].sqrt_()
    return both


@torch.no_grad()
def clip_gradients(model: ModelParts, max_norm: float, total_norm: torch.Tensor) -> None:
    if max_norm > 0:
        # A foreach kernel takes DTensors of one mesh; expert parameters (ep) live on their own.
        by_mesh: dict[object, list[torch.Tensor]] = {}
        for param in model.parameters():
            by_mesh.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=True)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    """No optimizer step was taken (fp16 overflow, or a non-finite loss/norm under 'skip')."""
    nan: bool
    """The loss or gradient norm was not finite."""
    found_inf: bool
    global_batch_size: int = 0
    lr: float = 0.0
    moe: dict | None = None
    """The MoE routing entries of the metrics record (dtgpt/moe/stats.py); None: a dense model."""
    mtp: dict | None = None
    """Each prediction depth's loss (`mtp_<k> loss`); None: no multi-token prediction."""


def train_step(cfg: Config, state: TrainState, batch: Batch | torch.Tensor | None) -> StepResult:
    """One training iteration on global batch k, in order, advancing `state` past it.

    Timers are the state's (built from logging.timers_log_level); faults, last words and the
    watchdog wrap this call from outside (dtgpt.faults). One host synchronisation per iteration:
    the loss and norm are read together (a non-finite norm under fp16 is the overflow), with an
    MoE model's routing statistics (dtgpt/moe/stats.py).
    """
    model, optimizer, scaler, timers = state.model, state.optimizer, state.scaler, state.timers
    global_batch_size = BatchSizeSchedule(cfg.training, cfg.model.seq_length).global_batch_size(state.progress.consumed_samples)
    microbatches = num_microbatches(cfg, model.dims.dp, global_batch_size)
    lr = state.lr_schedule.apply(optimizer)
    optimizer.zero_grad(set_to_none=True)
    with timers("forward-backward"):
        local_loss = local_forward_backward(
            model, batch, microbatches, loss_scale=scaler.scale, first_sample=state.progress.consumed_samples,
            per_token=cfg.training.calculate_per_token_loss,
        )
    timers("optimizer").start()
    with timers("grads-reduce-clip"):
        model.reduce_pending_grads()
        model.sync_tied_grads()
        if scaler.enabled:  # an inf/NaN gradient (an overflow) shows in the norm below
            scaler.unscale_and_check_([p.grad for p in model.parameters() if p.grad is not None])
        stats = model.routing_stats
        routing = stats.local(model.parts, model.device) if stats is not None else None
        routing = with_mtp_shares(model, routing)
        summed = reduce_loss_and_norm(model, local_loss, local_squared_grad_norm(model), routing)
        clip_gradients(model, cfg.optimizer.clip_grad, summed[1])
        loss_value, norm_value, *routing_values = summed.tolist()
        routing = summed[2:] if routing is not None else None
    result = classify(loss_value, norm_value, overflow=scaler.enabled and not math.isfinite(norm_value))
    if model.mtp_loss is not None:
        routing_values, result.mtp = mtp_summary(model, routing_values, microbatches)
    if stats is not None:  # Megatron moves the expert biases whether or not the step is taken
        stats.update_expert_biases(model.parts, routing)
        result.moe = stats.summary(routing_values, global_batch_size // cfg.training.micro_batch_size)
    if not result.skipped:
        with timers("optimizer-inner-step"):
            optimizer.step()
    scaler.update(result.found_inf)
    timers("optimizer").stop()
    state.record(skipped=result.skipped, nan=result.nan, global_batch_size=global_batch_size, loss_finite=math.isfinite(loss_value))
    return replace(result, global_batch_size=global_batch_size, lr=lr)


@torch.no_grad()
def evaluate(cfg: Config, model: ModelParts, batches: Iterator, num_batches: int) -> float:
    """The loss over `num_batches` global batches, forward only (through the pipeline if any):
    every token loss summed over every loss token of all of them, as Megatron's evaluate does
    (not a mean of per-batch means, which differs where batches hold different loss-token
    counts, e.g. under eod_mask_loss). One reduction at the end, over dp x cp and pp."""
    model.train(False)
    microbatches = num_microbatches(cfg, model.dims.dp, cfg.training.global_batch_size)
    totals = torch.zeros(2, device=model.device)
    for _ in range(num_batches):
        totals += torch.stack(local_loss_sum(model, next(batches), microbatches))
    model.train(True)
    loss_sum, count = reduce_loss(model, totals).tolist()
    return loss_sum / count if count else float("nan")


def classify(loss: float, grad_norm: float, overflow: bool) -> StepResult:
    """Under fp16 non-finite gradients are an overflow of the loss scale (skip, lower the scale);
    otherwise a non-finite loss or norm is a NaN iteration, handled by training.nan_policy."""
    nan = not overflow and not (math.isfinite(loss) and math.isfinite(grad_norm))
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=overflow or nan, nan=nan, found_inf=overflow)
