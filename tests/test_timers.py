"""Named timers by level, (min, max) across ranks, and the profiler's trace window."""

import json
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtgpt.profiling import Profiler
from dtgpt.timers import PHASE_LEVELS, NullTimer, Timer, Timers, format_times

CUDA_LABEL = torch.device("cuda")  # a device label only: these tests call no CUDA API (spies and env dicts stand in)

CPU = torch.device("cpu")
LEVEL1 = [n for n, lvl in PHASE_LEVELS.items() if lvl == 1]
LEVEL2 = [n for n, lvl in PHASE_LEVELS.items() if lvl == 2]


def _parse(text: str) -> dict[str, tuple[float, float]]:
    lines = text.splitlines()
    assert lines[0] == "(min, max) time across ranks (ms):"
    out = {}
    for line in lines[1:]:
        m = re.fullmatch(r"    (\S+) \.*: \(([\d.]+), ([\d.]+)\)", line)
        assert m, line
        out[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return out


def _run_all_phases(timers: Timers, seconds: float = 0.002) -> None:
    for name in PHASE_LEVELS:
        with timers(name):
            time.sleep(seconds)


def test_level_0_is_all_no_ops():
    timers = Timers(0, CPU)
    for name in PHASE_LEVELS:
        assert isinstance(timers(name), NullTimer)
    _run_all_phases(timers)
    timers("forward-backward").start()
    timers("forward-backward").start()  # a no-op never complains
    assert timers.min_max() == {}


def test_level_1_reports_only_level_1_phases():
    timers = Timers(1, CPU)
    assert all(isinstance(timers(n), Timer) for n in LEVEL1)
    assert all(isinstance(timers(n), NullTimer) for n in LEVEL2)
    _run_all_phases(timers)
    assert sorted(timers.min_max()) == sorted(LEVEL1)
    assert "pipeline-comm" not in PHASE_LEVELS  # the schedule runs send/recv inside forward-backward


def test_level_2_reports_all_and_resets():
    timers = Timers(2, CPU)
    _run_all_phases(timers, seconds=0.005)
    times = timers.min_max()
    assert sorted(times) == sorted(PHASE_LEVELS)
    for lo, hi in times.values():
        assert 4.0 < lo == hi
    assert timers("optimizer").elapsed(reset=False) == 0.0  # min_max reset it
    assert timers.min_max(names=["optimizer"]) == {"optimizer": (0.0, 0.0)}


class _Clock:
    """A perf_counter that moves only when told, so durations are exact."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_interval_totals_become_per_iteration_ms(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("dtgpt.timers.time.perf_counter", clock)
    timers = Timers(2, CPU)
    for seconds in (0.010, 0.020, 0.030):  # three iterations of one interval
        with timers("forward-backward"):
            clock.now += seconds
    with timers("my-phase", log_level=2):
        clock.now += 0.6
    times = timers.min_max(iterations=3, names=["forward-backward", "my-phase"])
    assert times["forward-backward"] == pytest.approx((20.0, 20.0))  # (10 + 20 + 30) / 3 ms
    assert times["my-phase"] == pytest.approx((200.0, 200.0))
    text = format_times(times)
    assert _parse(text) == {"forward-backward": (20.0, 20.0), "my-phase": (200.0, 200.0)}


def test_custom_level_and_misuse():
    timers = Timers(2, CPU)
    t = timers("my-phase", log_level=2)
    with pytest.raises(ValueError, match="my-other-phase"):
        timers("my-other-phase")  # unknown phase and no level
    with pytest.raises(RuntimeError, match="started twice"):
        t.start()
        t.start()


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        timers = Timers(1, CPU)
        with timers("forward-backward"):
            time.sleep(0.01 if rank == 0 else 0.15)
        if rank == 1:
            with timers("evaluate"):  # timed on one rank only: still reported
                time.sleep(0.01)
        text = format_times(timers.min_max(names=["forward-backward", "evaluate", "optimizer"]))
        with open(f"{out_dir}/rank{rank}.txt", "w") as f:
            f.write(text)
    finally:
        dist.destroy_process_group()


def test_min_max_across_two_gloo_ranks(tmp_path):
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    texts = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert texts[0] == texts[1]  # every rank gets the same reduced result
    times = _parse(texts[0])
    lo, hi = times["forward-backward"]
    assert lo > 8.0 and hi > 140.0 and hi > lo
    assert "optimizer" not in times  # timed on no rank
    assert times["evaluate"][0] > 8.0


def _matmul() -> None:
    a = torch.randn(64, 64)
    (a @ a).sum()


def test_profiler_writes_trace_for_window(tmp_path, capsys):
    trace_dir = tmp_path / "traces"
    prof = Profiler(2, 4, str(trace_dir), memory_snapshot_path=str(tmp_path / "snap.pickle"), rank=3, device=CPU)
    for it in range(1, 6):
        prof.step(it)
        _matmul()
        if it == 3:
            assert prof.running and not list(trace_dir.glob("*.json*"))  # nothing written mid-window
    assert not prof.running
    traces = list(trace_dir.glob("rank3*.pt.trace.json*"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert "skipped" in capsys.readouterr().out  # no CUDA: no memory snapshot
    assert not (tmp_path / "snap_rank3.pickle").exists()


def test_profiler_disabled_and_close_mid_window(tmp_path):
    off = Profiler(0, 4, str(tmp_path / "off"))
    for it in range(1, 6):
        off.step(it)
    assert not off.enabled and not (tmp_path / "off").exists()
    with pytest.raises(ValueError, match="profile_step_end"):
        Profiler(5, 5, str(tmp_path / "bad"))
    early = Profiler(1, 100, str(tmp_path / "early"), device=CPU)
    early.step(1)
    _matmul()
    early.close()  # the run ended inside the window: the trace is still written
    assert list((tmp_path / "early").glob("rank0*.pt.trace.json*"))


def test_profile_ranks_and_memory_history_are_megatrons(tmp_path, capsys, monkeypatch):
    """--profile-ranks: only those ranks profile; --record-memory-history: the allocator's history
    from the start (CUDA; here a spy stands in for torch's private calls, dtgpt/cuda_memory.py),
    dumped to Megatron's default snapshot.pickle, named per rank, after every log interval's
    iteration and at the end; on CPU one line says it is skipped."""
    from dtgpt import cuda_memory
    from dtgpt.config import load_config
    from dtgpt.profiling import build_profiler

    cfg = load_config(None, ["--profile-ranks", "1", "--record-memory-history", "--log-interval", "2", "--profile-step-start", "2",
                             "--profile-step-end", "3", f"--profiling.trace_dir={tmp_path / 't'}"], check=False)  # fmt: skip
    assert not build_profiler(cfg, 0, CPU).enabled and not build_profiler(cfg, 0, CPU).history_every
    calls = []
    monkeypatch.setattr(cuda_memory, "start_recording", lambda: calls.append("start"))
    monkeypatch.setattr(cuda_memory, "stop_recording", lambda: calls.append("stop"))
    monkeypatch.setattr(cuda_memory, "dump_snapshot", lambda path: calls.append(path))
    cfg.profiling.profile_step_start = 0  # the trace window is test_profiler_writes_trace_for_window's
    prof = build_profiler(cfg, 1, CUDA_LABEL)
    for it in range(1, 6):
        prof.step(it)
    prof.close()
    assert calls == ["start", "snapshot_rank1.pickle", "snapshot_rank1.pickle", "snapshot_rank1.pickle", "stop"]
    capsys.readouterr()
    build_profiler(cfg, 1, CPU)
    assert capsys.readouterr().out == "[rank1] profiling: memory history (snapshot_rank1.pickle) skipped: it records CUDA allocations and this run is on CPU\n"
