"""The global batch size as a function of samples consumed, and the run length it gives.

Two schedules grow the batch: Megatron's ramp-up (training.rampup_batch_size, linear steps over
a number of samples) and its step schedule (training.step_batch_size_schedule, "THRESHOLD:BS"
pairs over consumed tokens, megatron-core's StepBatchsizeNumMicroBatchesCalculator). Both are
pure arithmetic on the config, so validation, the planner, the loader and the train step ask
the same object. Sample-based training (training.train_samples) derives the iteration count
from them as Megatron's update_train_iters does (see train_iterations()).
"""

from __future__ import annotations

from typing import Iterator

from dtgpt.config.sections import ConfigError, TrainingConfig

STEP_KEY = "training.step_batch_size_schedule"
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
"""Megatron's threshold suffixes: powers of 1000, not of 1024."""


def _number(text: str, entry: str) -> int:
    """A count with an optional K/M/B/T suffix (any case), read as Megatron reads it: the digits
    as a float, times the suffix, truncated to an integer."""
    digits = text.strip().upper()
    scale = _SUFFIXES.get(digits[-1:], 1)
    if scale != 1:
        digits = digits[:-1]
    try:
        return int(float(digits) * scale)
    except (ValueError, OverflowError):
        raise ConfigError(f'{STEP_KEY}: "{entry}" is not THRESHOLD:BS with numbers (suffixes K, M, B, T)') from None


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """[(threshold in samples, global batch size)] in threshold order, from Megatron's format:
    pairs split by spaces or commas, token thresholds turned into samples by floor division by
    seq_length. The first threshold (in samples) must be 0, thresholds strictly increase and
    every batch size is positive, as megatron-core checks; each rule broken is a ConfigError."""
    if seq_length <= 0:
        raise ConfigError(f"model.seq_length={seq_length} must be > 0: {STEP_KEY} counts tokens")
    entries = text.replace(",", " ").split()
    if not entries:
        raise ConfigError(f'{STEP_KEY}="{text}" has no THRESHOLD:BS entry')
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise ConfigError(f'{STEP_KEY}: entry "{entry}" must look like THRESHOLD:BS (e.g. "0:768 250B:1536")')
        threshold, batch = entry.split(":", 1)
        schedule.append((_number(threshold, entry) // seq_length, _number(batch, entry)))
    schedule.sort(key=lambda pair: pair[0])
    if schedule[0][0] != 0:
        raise ConfigError(
            f'{STEP_KEY}="{text}": the first threshold must be 0 tokens (below seq_length={seq_length}), got '
            f"{schedule[0][0] * seq_length} or more"
        )
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ConfigError(
                f'{STEP_KEY}="{text}": thresholds must strictly increase in samples (tokens // seq_length='
                f"{seq_length}), but two are both {after} samples"
            )
    for _, batch in schedule:
        if batch <= 0:
            raise ConfigError(f'{STEP_KEY}="{text}": every batch size must be > 0, got {batch}')
    return schedule


def step_schedule(t: TrainingConfig, seq_length: int) -> list[tuple[int, int]]:
    """The run's step schedule in samples; [] without one."""
    return parse_step_schedule(t.step_batch_size_schedule, seq_length) if t.step_batch_size_schedule else []


def rampup_active(t: TrainingConfig) -> bool:
    """Whether training.rampup_batch_size ramps at all: one that starts at the final size or
    lasts no samples is no ramp (the first batch is then global_batch_size)."""
    return bool(t.rampup_batch_size) and t.rampup_batch_size[0] < t.global_batch_size and t.rampup_batch_size[2] > 0


def smallest_batch_size(t: TrainingConfig, seq_length: int) -> tuple[int, str]:
    """The smallest global batch of the run (its fewest micro-batches), and the key that sets it."""
    if t.step_batch_size_schedule:
        return min(batch for _, batch in step_schedule(t, seq_length)), STEP_KEY
    if rampup_active(t):
        return t.rampup_batch_size[0], "training.rampup_batch_size start"
    return t.global_batch_size, "training.global_batch_size"


class BatchSizeSchedule:
    """The global batch size as a function of samples consumed so far.

    Step schedule: the batch of the last entry whose threshold is <= the samples consumed
    (megatron-core's StepBatchsizeNumMicroBatchesCalculator); its last batch is global_batch_size.

    Ramp-up, rampup_batch_size = [start, incr, ramp_samples]: the batch grows from `start` by
    `incr` in equal slices of ramp_samples / num_increments samples, and is global_batch_size
    once more than ramp_samples have been consumed. The float division and the strict comparison
    are kept as Megatron writes them (at exactly ramp_samples the division may land just short of
    the last increment), so the batch sizes match Megatron's sample for sample
    (tests/test_megatron_oracle_schedules.py).

    dtgpt also allows the ramp-up with train_iters (Megatron refuses it): an iteration is one
    optimizer step whose batch is global_batch_size(samples consumed before it), so the samples
    consumed after i iterations are a function of i alone (see consumed_samples()).
    """

    def __init__(self, cfg: TrainingConfig, seq_length: int = 0):
        self.final = cfg.global_batch_size
        if cfg.step_batch_size_schedule and seq_length <= 0:
            raise ValueError("a step batch-size schedule counts tokens: pass the model's seq_length")
        self.steps = step_schedule(cfg, seq_length)
        ramp = list(cfg.rampup_batch_size)  # validated: [start, increment, samples]
        self.enabled = rampup_active(cfg) and not self.steps
        self.start, self.increment, self.ramp_samples = ramp if self.enabled else (self.final, 0, 0)
        if self.steps:
            self.start = self.steps[0][1]
        self.num_increments = (self.final - self.start) // self.increment if self.enabled else 0
        self._samples_per_increment = self.ramp_samples / self.num_increments if self.enabled else 0.0

    def global_batch_size(self, consumed_samples: int) -> int:
        """The batch of the iteration that starts after `consumed_samples` samples."""
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must be >= 0")
        if self.steps:
            return next(batch for threshold, batch in reversed(self.steps) if consumed_samples >= threshold)
        if not self.enabled or consumed_samples > self.ramp_samples:
            return self.final
        steps = int(consumed_samples / self._samples_per_increment)
        return min(self.start + steps * self.increment, self.final)

    def _plateau_end(self, consumed: int) -> int:
        """The first sample count after `consumed` at which the ramp-up's batch size changes."""
        batch = self.global_batch_size(consumed)
        steps = (batch - self.start) // self.increment
        # Exact rational estimate, then nudged to where the float rule really switches.
        end = min(-(-(steps + 1) * self.ramp_samples // self.num_increments), self.ramp_samples)
        end = max(end, consumed + 1)
        while end - 1 > consumed and self.global_batch_size(end - 1) != batch:
            end -= 1
        while self.global_batch_size(end) == batch:
            end += 1
        return end

    def _plateaus(self) -> Iterator[tuple[int, int]]:
        """(batch size, iterations at it) for each batch size the run uses before its last one."""
        consumed = 0
        if self.steps:
            for (_, batch), (next_threshold, _) in zip(self.steps, self.steps[1:]):
                if consumed >= next_threshold:  # the batch before overshot this entry
                    continue
                span = -(-(next_threshold - consumed) // batch)
                yield batch, span
                consumed += span * batch
            return
        while (batch := self.global_batch_size(consumed)) != self.final:
            span = -(-(self._plateau_end(consumed) - consumed) // batch)  # iterations at this batch
            yield batch, span
            consumed += span * batch

    def sizes(self) -> list[int]:
        """Every global batch size the run's iterations use, in order, the final one last (a
        ramp-up can step over some of start + k * increment)."""
        return [batch for batch, _ in self._plateaus()] + [self.final]

    def consumed_samples(self, iterations: int) -> int:
        """Samples consumed by the first `iterations` iterations.

        Walks whole plateaus of constant batch size, so the cost is O(number of batch sizes),
        not O(iterations).
        """
        if iterations < 0:
            raise ValueError(f"iterations={iterations} must be >= 0")
        consumed, left = 0, iterations
        for batch, span in self._plateaus():
            done = min(span, left)
            consumed, left = consumed + done * batch, left - done
            if left == 0:
                return consumed
        return consumed + left * self.final

    def iterations_to_reach(self, samples: int) -> int:
        """Iterations until at least `samples` are consumed (the last batch may pass it), as
        Megatron counts a step schedule's iterations in sample-based training."""
        consumed, iterations = 0, 0
        for batch, span in self._plateaus():
            done = min(span, -(-(samples - consumed) // batch)) if consumed < samples else 0
            consumed, iterations = consumed + done * batch, iterations + done
            if done < span:
                return iterations
        return iterations + max(0, -(-(samples - consumed) // self.final))


def train_iterations(t: TrainingConfig, seq_length: int) -> int:
    """The run's iteration count: training.train_iters, or with train_samples the count Megatron's
    update_train_iters derives: a step schedule runs until train_samples are consumed (its last
    batch may pass them); a constant batch runs train_samples // global_batch_size iterations;
    a ramp-up counts its iterations up to the end of the ramp, then whole final batches (a
    partial last batch is dropped)."""
    if t.train_samples is None:
        return t.train_iters
    schedule = BatchSizeSchedule(t, seq_length)
    if schedule.steps:
        return schedule.iterations_to_reach(t.train_samples)
    if not schedule.enabled:
        return t.train_samples // t.global_batch_size
    iterations = consumed = 0
    while consumed <= schedule.ramp_samples and consumed <= t.train_samples:
        consumed += schedule.global_batch_size(consumed)
        iterations += 1
    return iterations + max(0, t.train_samples - consumed) // t.global_batch_size


def total_train_samples(t: TrainingConfig, seq_length: int = 0) -> int:
    """Samples read over the whole run: the sum of the batches of its iterations (with
    train_samples, at least train_samples, the count Megatron builds its dataset for)."""
    consumed = BatchSizeSchedule(t, seq_length).consumed_samples(train_iterations(t, seq_length))
    return max(consumed, t.train_samples or 0)
