"""Named timers by level, (min, max) across ranks, and the profiler's trace window."""

import json
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtgpt.profiling import Profiler
from dtgpt.timers import PHASE_LEVELS, NullTimer, Timer, Timers

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


def test_level_0_is_all_no_ops(capsys):
    timers = Timers(0, CPU)
    for name in PHASE_LEVELS:
        assert isinstance(timers(name), NullTimer)
    _run_all_phases(timers)
    timers("forward-backward").start()
    timers("forward-backward").start()  # a no-op never complains
    assert timers.log(list(PHASE_LEVELS), iteration=1) is None
    assert capsys.readouterr().out == ""


def test_level_1_reports_only_level_1_phases(capsys):
    timers = Timers(1, CPU)
    assert all(isinstance(timers(n), Timer) for n in LEVEL1)
    assert all(isinstance(timers(n), NullTimer) for n in LEVEL2)
    _run_all_phases(timers)
    text = timers.log(list(PHASE_LEVELS), iteration=1)
    assert capsys.readouterr().out.strip() == text  # printed on the (only, last) rank
    assert sorted(_parse(text)) == sorted(LEVEL1)


def test_level_2_reports_all_and_resets():
    timers = Timers(2, CPU)
    _run_all_phases(timers, seconds=0.005)
    times = _parse(timers.log(list(PHASE_LEVELS), iteration=1))
    assert sorted(times) == sorted(PHASE_LEVELS)
    for lo, hi in times.values():
        assert 4.0 < lo == hi < 1000.0
    assert timers("optimizer").elapsed(reset=False) == 0.0  # log reset it
    halved = _parse(timers.log(["optimizer"], iteration=2, normalizer=2.0))
    assert halved["optimizer"] == (0.0, 0.0)


def test_normalizer_custom_level_and_misuse():
    timers = Timers(2, CPU)
    t = timers("my-phase", log_level=2)
    t.start()
    time.sleep(0.02)
    t.stop()
    per_iter = _parse(timers.log(["my-phase"], iteration=1, normalizer=10.0))["my-phase"][0]
    assert 1.5 < per_iter < 100.0
    with pytest.raises(ValueError, match="my-other-phase"):
        timers("my-other-phase")  # unknown phase and no level
    with pytest.raises(RuntimeError, match="started twice"):
        t.start()
        t.start()
    with pytest.raises(ValueError):
        Timers(3, CPU)


class _FakeWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_write_tensorboard_does_not_reset():
    timers = Timers(1, CPU)
    with timers("evaluate"):
        time.sleep(0.003)
    writer = _FakeWriter()
    timers.write_tensorboard(writer, 7, ["evaluate", "optimizer"])
    assert [(tag, step) for tag, _, step in writer.scalars] == [("evaluate-time", 7)]
    assert writer.scalars[0][1] > 2.0
    assert timers("evaluate").elapsed(reset=False) > 0.002


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        timers = Timers(1, CPU)
        with timers("forward-backward"):
            time.sleep(0.01 if rank == 0 else 0.15)
        if rank == 1:
            with timers("evaluate"):  # timed on one rank only: still reported
                time.sleep(0.01)
        text = timers.log(["forward-backward", "evaluate", "optimizer"], iteration=1, print_rank=0)
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
    assert 8.0 < lo < 100.0 and hi > 140.0 and hi > lo
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
