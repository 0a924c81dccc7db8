"""Timers and the profiler through real train.py runs (one launch: tests/runs.py launch_commands)."""

import pytest

from tests.runs import TINY, Command, launch_commands, read_metrics, selected_cases

pytestmark = pytest.mark.slow  # train.py runs

HEADER = "(min, max) time across ranks (ms):"
LEVELS = {
    # timers_log_level: (timers printed, timers not printed)
    0: ([], ["forward-backward", "optimizer ...", "batch-generator"]),
    1: (["forward-backward", "optimizer ..."], ["batch-generator", "grads-reduce-clip", "optimizer-inner-step"]),
    2: (["forward-backward", "optimizer ...", "batch-generator", "grads-reduce-clip", "optimizer-inner-step"], []),
}


# TINY's batch of 8 in 2 micro-batches (its 8 add nothing: the timers count an iteration's whole)
SHORT = [*TINY, "--training.train_iters=4", "--training.micro_batch_size=4"]


def level_args(level: int, directory) -> list[str]:
    args = SHORT + ["--logging.log_interval=2", f"--logging.timers_log_level={level}"]
    if level == 2:
        args += ["--profiling.profile_step_start=2", "--profiling.profile_step_end=4", f"--profiling.trace_dir={directory / 'trace'}"]
    return args


def phase_args(directory) -> list[str]:
    return SHORT + ["--logging.log_interval=4", "--logging.timers_log_level=2",
                    f"--logging.tensorboard_dir={directory / 'tb'}", f"--logging.metrics_file={directory / 'm.jsonl'}"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """The selected tests' one-process runs in one launch: {key: (Finished, its directory)}."""
    commands = []
    for case in selected_cases(request, test_timer_levels):
        directory = tmp_path_factory.mktemp(f"level{case}")
        commands.append(Command(f"level{case}", directory, level_args(int(case), directory)))
    if selected_cases(request, test_phase_times_reach_tensorboard_per_iteration):
        directory = tmp_path_factory.mktemp("phases")
        commands.append(Command("phases", directory, phase_args(directory)))
    finished = launch_commands(commands) if commands else {}
    return {c.key: (finished[c.key], c.directory) for c in commands}


def printed(runs: dict, key: str):
    """(what a run printed, its directory); a run that failed fails the test with its log."""
    finished, directory = runs[key]
    return finished.checked(), directory


@pytest.mark.parametrize("level", list(LEVELS), ids=str)
def test_timer_levels(runs, level):
    present, absent = LEVELS[level]
    out, tmp_path = printed(runs, f"level{level}")
    assert (HEADER in out) == (level > 0)
    if level:
        assert out.count(HEADER) == 2  # every log_interval
    for name in present:
        assert name in out
    for name in absent:
        assert name not in out
    if level == 2:
        traces = list((tmp_path / "trace").glob("rank0*.pt.trace.json*"))
        assert traces and traces[0].stat().st_size > 1000


def test_phase_times_reach_tensorboard_per_iteration(runs):
    """A short run with tensorboard_dir set has `<phase>-time` scalars in its event file, and the
    times are per iteration: an interval's forward-backward total divided by its iterations fits
    inside the mean iteration time (the total itself would not: it spans four iterations)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tmp_path = printed(runs, "phases")
    tb, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    acc = EventAccumulator(str(tb))
    acc.Reload()
    phases = ("forward-backward", "optimizer", "batch-generator", "grads-reduce-clip", "optimizer-inner-step")
    for phase in phases:
        assert [e.step for e in acc.Scalars(f"{phase}-time")] == [4], phase
    timers_ms = read_metrics(metrics)[-1]["timers_ms"]
    assert sorted(timers_ms) == sorted(phases)
    lo, hi = timers_ms["forward-backward"]
    assert lo == hi  # one rank
    assert "forward-backward ".ljust(48, ".") + f": ({lo:.2f}, {hi:.2f})" in out
    assert acc.Scalars("forward-backward-time")[0].value == pytest.approx(hi, rel=1e-6)
    mean_iteration_ms = 1000 * sum(e.value for e in acc.Scalars("iteration-time")) / 4
    assert 0 < hi <= mean_iteration_ms * (1 + 1e-5)
