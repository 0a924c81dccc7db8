"""The profile `scripts/bench.py --profile` takes of each side: what a step launches and how busy it keeps the device.

Per step, over a few steps under torch.profiler after the timed ones:

- kernels: CUDA kernels launched (on a CPU: aten ops dispatched, nested ones included, the proxy);
- busy: the fraction of the steps' wall time (host clock, from the first launch to the final
  synchronisation) during which some kernel ran (the union of kernel intervals; CUDA only);
- optimizer: the time of `optimizer.step()` (torch's own "Optimizer.step#..." range): its kernels'
  device time on CUDA, its host time on a CPU.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dtgpt.profiling import quiet_kineto

PROFILED_STEPS = 3


def _busy_time_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profile_steps(step: Callable[[torch.Tensor], float], batches: list[torch.Tensor], device: torch.device) -> dict:
    """{"kernels", "busy", "optimizer_ms"} per step, over PROFILED_STEPS steps of `step`."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    quiet_kineto()
    with profile(activities=activities, acc_events=True) as prof:  # one cycle: acc_events only stops 2.11's warning
        start = time.perf_counter()
        for i in range(PROFILED_STEPS):
            step(batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize(device)
        wall_us = 1e6 * (time.perf_counter() - start)
    events = prof.events()
    optimizer = [e for e in events if e.name.startswith("Optimizer.step#")]
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = _busy_time_us([(k.time_range.start, k.time_range.end) for k in kernels])
        optimizer_us = sum(e.device_time_total for e in optimizer)
    else:
        kernels = [e for e in events if e.name.startswith("aten::")]
        busy = None
        optimizer_us = sum(e.cpu_time_total for e in optimizer)
    return {
        "kernels": len(kernels) / PROFILED_STEPS,
        "kernel_kind": "CUDA kernels" if cuda else "aten ops (CPU)",
        "busy": busy / wall_us if busy is not None else None,
        "optimizer_ms": optimizer_us / 1000 / PROFILED_STEPS,
        "optimizer_kind": "device" if cuda else "host",
    }


def print_profiles(result: dict) -> None:
    rows = [(impl, result[impl].get("profile")) for impl in ("dtgpt", "reference")]
    if not any(p for _, p in rows):
        return
    kind = next(p for _, p in rows if p)
    print(f"  {'profile':<10} {kind['kernel_kind'] + '/step':>22} {'busy':>6} {'optimizer ms/step (' + kind['optimizer_kind'] + ')':>28}")
    for impl, p in rows:
        if p:
            busy = "-" if p["busy"] is None else f"{100 * p['busy']:.0f}%"
            print(f"  {impl:<10} {p['kernels']:>22,.0f} {busy:>6} {p['optimizer_ms']:>28.2f}")
