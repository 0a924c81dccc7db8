"""A torch.profiler trace (and optionally a CUDA memory snapshot) over a window of iterations.

Call `Profiler.step(iteration)` at the top of every iteration, before its work. The profiler
starts when `iteration == start_iter` and stops, writing the trace, when `iteration == end_iter`,
so the trace covers iterations start_iter .. end_iter - 1. `close()` writes whatever was being
recorded if training ends inside the window. Traces go through
`torch.profiler.tensorboard_trace_handler`, one `rank{N}.*.pt.trace.json` per rank, which both
TensorBoard's profiler plugin and chrome://tracing / Perfetto open.

Megatron's --record-memory-history (profiling.record_memory_history) records the CUDA allocator's
history from the start of training instead, dumping it at every log interval; profiling.profile_ranks
(--profile-ranks) limits both to some ranks. build_profiler reads the config.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from dtgpt import cuda_memory

MEGATRON_SNAPSHOT = "snapshot.pickle"
"""Megatron's default --memory-snapshot-path."""


def quiet_kineto() -> None:
    """torch.profiler's tracer (kineto) prints a `USDT:... profiler_start` / `profiler_stop` line
    at each start and stop on torch 2.13 at every KINETO_LOG_LEVEL below 6 (USDT is its top level,
    6 turns its log off), and torch 2.11's CUDA build an `ERROR: gpuGetDeviceCount` line on a host
    without a GPU. kineto reads the variable once, at the first profiler of the process, so this
    is called before it; a user who wants kineto's lines sets KINETO_LOG_LEVEL and keeps them."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def count_ops_profile() -> torch.profiler.profile:
    """A CPU profiler for counting the aten ops of a region, printing nothing of its own (the bench
    scripts). One cycle: `acc_events` only stops torch 2.11's warning that a new cycle clears the
    events of the last."""
    quiet_kineto()
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True)


def _snapshot_path(path: str, rank: int) -> str:
    """Per-rank file name: '{rank}' in the path is filled in, else '_rank{N}' goes before the
    extension, so ranks sharing a file system never overwrite each other."""
    if "{rank}" in path:
        return path.format(rank=rank)
    root, ext = os.path.splitext(path)
    return f"{root}_rank{rank}{ext}"


class Profiler:
    """Profiles iterations [start_iter, end_iter); a no-op when start_iter <= 0 or no trace_dir."""

    def __init__(
        self,
        start_iter: int,
        end_iter: int,
        trace_dir: str,
        memory_snapshot_path: str = "",
        rank: int = 0,
        device: Optional[torch.device] = None,
        history_every: int = 0,
    ) -> None:
        """history_every > 0: record the allocator's history from now on, dumped to
        memory_snapshot_path (default snapshot.pickle) every that many iterations."""
        self.enabled = start_iter > 0 and bool(trace_dir)
        if self.enabled and end_iter <= start_iter:
            raise ValueError(
                f"profiling.profile_step_end={end_iter} must be > profiling.profile_step_start={start_iter}"
            )
        self.start_iter = start_iter
        self.end_iter = end_iter
        self.trace_dir = trace_dir
        self.rank = rank
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.on_cuda = device.type == "cuda"
        self.history_every = history_every
        self.history_path = _snapshot_path(memory_snapshot_path or MEGATRON_SNAPSHOT, rank) if history_every else ""
        self.memory_snapshot_path = _snapshot_path(memory_snapshot_path, rank) if memory_snapshot_path and not history_every else ""
        self._prof: Optional[torch.profiler.profile] = None
        if history_every and self.on_cuda:
            cuda_memory.start_recording()
        elif history_every:
            self._cpu_skip(f"memory history ({self.history_path})")

    def _cpu_skip(self, what: str) -> None:
        print(f"[rank{self.rank}] profiling: {what} skipped: it records CUDA allocations and this run is on CPU", flush=True)

    @property
    def running(self) -> bool:
        return self._prof is not None

    def step(self, iteration: int) -> None:
        if self.history_every and self.on_cuda and iteration > 1 and (iteration - 1) % self.history_every == 0:
            cuda_memory.dump_snapshot(self.history_path)  # after iteration - 1, as Megatron dumps at its log line
        if not self.enabled:
            return
        if iteration == self.start_iter and not self.running:
            self._start()
        elif self.running:
            if iteration >= self.end_iter:
                self._stop()
            else:
                self._prof.step()  # marks "ProfilerStep#N" boundaries in the trace

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.trace_dir, exist_ok=True)
        self._prof = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            acc_events=True,  # one cycle per profiler: only stops torch 2.11's warning (count_ops_profile)
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}"),
        )
        if self.memory_snapshot_path:
            if self.on_cuda:
                cuda_memory.start_recording()
            else:
                self._cpu_skip(f"memory snapshot {self.memory_snapshot_path}")
        self._prof.start()

    def _stop(self) -> None:
        self._prof.stop()  # calls the trace handler, which writes the file
        self._prof = None
        if self.memory_snapshot_path and self.on_cuda:
            cuda_memory.dump_snapshot(self.memory_snapshot_path)
            cuda_memory.stop_recording()
        print(f"[rank{self.rank}] profiling: trace written to {self.trace_dir}", flush=True)

    def close(self) -> None:
        """Write a trace still being recorded (the run ended before end_iter), and the memory history."""
        if self.running:
            self._stop()
        if self.history_every and self.on_cuda:
            cuda_memory.dump_snapshot(self.history_path)
            cuda_memory.stop_recording()
            self.history_every = 0


def build_profiler(cfg, rank: int, device: torch.device) -> Profiler:
    """The [profiling] section's profiler for this rank: a no-op on a rank outside profile_ranks."""
    prof = cfg.profiling
    chosen = not prof.profile_ranks or rank in prof.profile_ranks
    return Profiler(
        prof.profile_step_start if chosen else 0, prof.profile_step_end, prof.trace_dir, prof.memory_snapshot_path,
        rank=rank, device=device, history_every=cfg.logging.log_interval if chosen and prof.record_memory_history else 0,
    )  # fmt: skip
