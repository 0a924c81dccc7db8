"""torch's pipeline schedules at every micro-batch count a batch-size ramp-up produces.

Three of torch's schedules refuse counts that Megatron runs, or that torch's own construction
runs with another round size. Each class here is the torch schedule, built without that refusal:
its step, its per-rank order and its runtime are torch's; only the count check (and, for the
interleaved ones, the round size) differ.

- 1F1B with fewer micro-batches than stages: torch's step already caps each stage's warm-up
  at the count, so it runs what Megatron runs (warm-up min(pp - rank - 1, n), then 1F1B).
- Interleaved1F1B and InterleavedZeroBubble with a count that their rounds do not divide: the
  rounds are made the smallest divisor >= pp of the count (config.derived.interleaved_round_size).

GPipe, LoopedBFS and ZBVZeroBubble run every count as torch builds them; DualPipeV needs at
least as many micro-batches as stages, a rule validation checks (config/parallel_rules.py).

The constructors lean on torch's private schedule internals (_PipelineScheduleRuntime, each
class's _calculate_single_rank_operations); tests/test_pipeline_schedules.py checks them against
torch's own classes and dry run, so a torch that changes them fails there first.
"""

from __future__ import annotations

from typing import Callable

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

from dtgpt.config import interleaved_round_size


class Schedule1F1BAnyCount(Schedule1F1B):
    """torch's 1F1B, fewer micro-batches than stages included.

    Schedule1F1B refuses n < stages, yet its step already runs min(n, stages - stage) forwards
    before the first backward (Megatron's warm-up min(pp - rank - 1, n) and the first steady
    forward): with n < stages the first stages have an empty steady phase, as in Megatron.
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable, scale_grads: bool):
        # Schedule1F1B's constructor is PipelineScheduleSingle's plus the refusal.
        PipelineScheduleSingle.__init__(self, stage, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)

    def _get_pipeline_order(self):
        # torch's printable order assumes n >= stages (it would list micro-batches that do not
        # exist below it); the step never reads it.
        return super()._get_pipeline_order() if self._n_microbatches >= self._num_stages else None


def _start_rounds(schedule: _PipelineScheduleRuntime, stages: list[PipelineStage], n: int, loss_fn, scale_grads) -> None:
    """What torch's interleaved constructors do before their per-rank order, with equal rounds
    of interleaved_round_size(n, pp) micro-batches (torch's rounds need not divide n)."""
    schedule.pp_group_size = stages[0].group_size
    _PipelineScheduleRuntime.__init__(schedule, stages=stages, n_microbatches=n, loss_fn=loss_fn, scale_grads=scale_grads)
    schedule.n_local_stages = len(stages)
    schedule.rank = stages[0].group_rank
    schedule.microbatches_per_round = interleaved_round_size(n, schedule.pp_group_size)
    schedule.number_of_rounds = n // schedule.microbatches_per_round
    schedule.pipeline_order = {rank: schedule._calculate_single_rank_operations(rank) for rank in range(schedule.pp_group_size)}


class ScheduleInterleaved1F1BAnyCount(ScheduleInterleaved1F1B):
    """torch's Interleaved1F1B with rounds that divide every count."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, scale_grads: bool):
        _start_rounds(self, stages, n_microbatches, loss_fn, scale_grads)
        self._prepare_schedule_with_comms(self.pipeline_order)


class ScheduleInterleavedZeroBubbleAnyCount(ScheduleInterleavedZeroBubble):
    """torch's InterleavedZeroBubble (ZB1P) with rounds that divide every count."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, scale_grads: bool):
        # torch's constructor also refuses compiled stages; config/parallel_rules.py refuses compile here.
        _start_rounds(self, stages, n_microbatches, loss_fn, scale_grads)
        self.pipeline_order = self._add_bubbles_to_actions(self.n_local_stages * self.pp_group_size)
        self._prepare_schedule_with_comms(self.pipeline_order)


ANY_COUNT = {
    "1F1B": Schedule1F1BAnyCount,
    "Interleaved1F1B": ScheduleInterleaved1F1BAnyCount,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubbleAnyCount,
}


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable) -> _PipelineSchedule:
    """The schedule `name` over this rank's stages for n_microbatches micro-batches.

    scale_grads=False: the loss already divides by the global batch's token count.
    """
    cls = ANY_COUNT.get(name) or get_schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    return cls(stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
