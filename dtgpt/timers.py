"""Named phase timers in Megatron's style: `timers("optimizer").start()` ... `.stop()`.

Each timer has a level (1: coarse phases, 2: finer ones). `Timers(log_level)` builds real timers
only for levels <= log_level; any other name gets a shared no-op object, so an instrumented
trainer costs nothing at log_level 0 (the default): no clock reads, no CUDA sync.

A real timer on CUDA calls `torch.cuda.synchronize()` before every clock read, because kernels
run asynchronously and the clock would otherwise measure only the launch. That sync stalls the
CPU's run-ahead and slows training, which is why it only happens when timers are asked for.

Phase names the trainer uses (see PHASE_LEVELS): level 1 `forward-backward`, `optimizer`,
`save-checkpoint`, `evaluate`; level 2 `batch-generator`, `grads-reduce-clip`,
`optimizer-inner-step`. Pipeline send/recv is not timed apart: torch.distributed.pipelining
runs it inside the schedule, so it is part of `forward-backward`.

`Timers.min_max()` turns a log interval's totals into per-iteration milliseconds, (min, max) over
ranks; dtgpt.metrics.MetricsLogger prints them and writes them to TensorBoard and the metrics file.
"""

from __future__ import annotations

import time
import types
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

PHASE_LEVELS: Mapping[str, int] = types.MappingProxyType(
    {
        "forward-backward": 1,  # all micro-batches of one iteration, pipeline schedule included
        "optimizer": 1,  # grad reduction/clipping + optimizer step + zero_grad
        "save-checkpoint": 1,
        "evaluate": 1,
        "batch-generator": 2,  # fetching the next global batch from the data iterator
        "grads-reduce-clip": 2,  # grad-norm all-reduce and clipping
        "optimizer-inner-step": 2,  # optimizer.step() itself
    }
)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class NullTimer:
    """Stands in for a timer above the configured level: every method does nothing."""

    active = False

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0

    def __enter__(self) -> "NullTimer":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Timer:
    """Accumulates wall time over start/stop pairs until reset."""

    active = True

    def __init__(self, name: str, level: int, sync_cuda: Optional[torch.device]) -> None:
        self.name = name
        self.level = level
        self._sync_device = sync_cuda
        self._total = 0.0
        self._started_at: Optional[float] = None

    def _now(self) -> float:
        if self._sync_device is not None:
            torch.cuda.synchronize(self._sync_device)
        return time.perf_counter()

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def start(self, barrier: bool = False) -> None:
        """`barrier=True` lines ranks up first so the time excludes waiting for stragglers."""
        if self.running:
            raise RuntimeError(f"timer {self.name!r} started twice")
        if barrier:
            _barrier()
        self._started_at = self._now()

    def stop(self, barrier: bool = False) -> None:
        if not self.running:
            raise RuntimeError(f"timer {self.name!r} stopped without start")
        if barrier:
            _barrier()
        self._total += self._now() - self._started_at
        self._started_at = None

    def reset(self) -> None:
        self._total = 0.0
        if self.running:
            self._started_at = self._now()

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far, including a running span (which keeps running)."""
        total = self._total
        if self.running:
            now = self._now()
            total += now - self._started_at
            if reset:
                self._started_at = now
        if reset:
            self._total = 0.0
        return total

    def __enter__(self) -> "Timer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_NULL_TIMER = NullTimer()  # stateless, so one instance serves every disabled name


class Timers:
    """The set of named timers of one rank, filtered by `log_level` (0, 1 or 2: validated with the
    config, logging.timers_log_level)."""

    def __init__(self, log_level: int, device: torch.device) -> None:
        self.log_level = log_level
        self.device = torch.device(device)
        self._sync = self.device if self.device.type == "cuda" and log_level > 0 else None
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, log_level: Optional[int] = None) -> Timer | NullTimer:
        """The timer `name`; its level defaults to PHASE_LEVELS[name]."""
        level = PHASE_LEVELS.get(name) if log_level is None else log_level
        if level not in (1, 2):
            raise ValueError(f"timer {name!r}: log_level={level} must be 1 or 2 (not a known phase: pass it)")
        if level > self.log_level:
            return _NULL_TIMER
        if name not in self._timers:
            self._timers[name] = Timer(name, level, self._sync)
        return self._timers[name]

    def min_max(self, iterations: int = 1, names: Sequence[str] = tuple(PHASE_LEVELS)) -> dict[str, tuple[float, float]]:
        """Per-iteration milliseconds of each named timer, (min, max) over ranks, then reset.

        `iterations` is how many iterations the totals cover (the log interval), so a phase that
        runs once per iteration reads as its own duration. A collective when distributed: every
        rank calls it at the same point. One all-reduce(MAX) of [-t..., t...] gives both ends; a
        name this rank never timed enters as -inf so it does not pull the result, and a name
        timed on no rank is left out. {} at log level 0, without a collective.
        """
        if self.log_level == 0:
            return {}
        neg_inf = float("-inf")
        local = [self._timers[n].elapsed() if n in self._timers else None for n in names]
        values = [-t if t is not None else neg_inf for t in local] + [t if t is not None else neg_inf for t in local]
        if dist.is_available() and dist.is_initialized():
            # NCCL only reduces CUDA tensors; gloo takes CPU ones.
            where = self.device if self.device.type == "cuda" else torch.device("cpu")
            buf = torch.tensor(values, dtype=torch.float64, device=where)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX)
            values = buf.tolist()
        n, ms = len(names), 1000.0 / iterations
        return {name: (-values[i] * ms, values[n + i] * ms) for i, name in enumerate(names) if values[n + i] != neg_inf}


def format_times(times: dict[str, tuple[float, float]]) -> str:
    """Megatron's timer block: one `name ....: (min, max)` line per phase, in ms."""
    lines = ["(min, max) time across ranks (ms):"]
    for name, (lo, hi) in times.items():
        lines.append(f"{f'    {name} '.ljust(52, '.')}: ({lo:.2f}, {hi:.2f})")
    return "\n".join(lines)
