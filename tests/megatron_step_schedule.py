"""megatron-core's StepBatchsizeNumMicroBatchesCalculator as the oracle of the step schedule.

The calculator came with megatron-core 0.18 (where it replaced the ramp-up calculator); under an
older megatron-core (the project venv's 0.16.1) every comparison here skips, naming the version.
It is built directly, in this process, without a process group: only arithmetic.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import pytest

from dtgpt.config import Config, num_microbatches
from dtgpt.config.batch_schedule import BatchSizeSchedule


def megatron_step_calculator(schedule: str, seq_length: int, micro_batch_size: int, data_parallel_size: int):
    """megatron-core's calculator of `schedule` (thresholds in tokens of seq_length), or a skip
    when the installed megatron-core predates it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's import notes about absent GPU kernels
        from importlib.metadata import version

        from megatron.core import num_microbatches_calculator
    calculator = getattr(num_microbatches_calculator, "StepBatchsizeNumMicroBatchesCalculator", None)
    if calculator is None:
        pytest.skip(
            f"megatron-core {version('megatron-core')} has no StepBatchsizeNumMicroBatchesCalculator "
            "(added in 0.18): run under megatron-core >= 0.19 to compare the step schedule"
        )
    return calculator(
        micro_batch_size=micro_batch_size, data_parallel_size=data_parallel_size, decrease_batch_size_if_needed=False,
        rank=0, schedule=schedule, seq_length=seq_length,
    )  # fmt: skip


def compare_with_megatron(cfg: Config, data_parallel_size: int, consumed: Iterable[int]) -> int:
    """Assert dtgpt's global batch and micro-batches per rank equal megatron-core's at every
    consumed-sample count, and that a run of cfg's iterations walks the same batches; returns
    the number of counts compared."""
    t, seq_length = cfg.training, cfg.model.seq_length
    theirs = megatron_step_calculator(t.step_batch_size_schedule, seq_length, t.micro_batch_size, data_parallel_size)
    ours = BatchSizeSchedule(t, seq_length)
    assert ours.final == theirs.global_batch_size  # the schedule's last batch is the global batch
    compared = 0
    for samples in consumed:
        theirs.update(samples, consistency_check=True)
        batch = ours.global_batch_size(samples)
        assert batch == theirs.get_current_global_batch_size(), samples
        assert num_microbatches(cfg, data_parallel_size, batch) == theirs.get(), samples
        compared += 1
    return compared
