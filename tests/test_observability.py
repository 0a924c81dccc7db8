"""Timers and the profiler through real train.py runs."""

import pytest

from tests.runs import TINY, read_metrics, run_train

pytestmark = pytest.mark.slow  # train.py runs

HEADER = "(min, max) time across ranks (ms):"


@pytest.mark.parametrize(
    "level,present,absent",
    [
        (0, [], ["forward-backward", "optimizer ...", "batch-generator"]),
        (1, ["forward-backward", "optimizer ..."], ["batch-generator", "grads-reduce-clip", "optimizer-inner-step"]),
        (2, ["forward-backward", "optimizer ...", "batch-generator", "grads-reduce-clip", "optimizer-inner-step"], []),
    ],
)
def test_timer_levels(tmp_path, level, present, absent):
    args = TINY + ["--training.train_iters=4", "--logging.log_interval=2", f"--logging.timers_log_level={level}"]
    if level == 2:
        args += ["--profiling.profile_step_start=2", "--profiling.profile_step_end=4", f"--profiling.trace_dir={tmp_path / 'trace'}"]
    out = run_train(tmp_path, args).stdout
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


def test_phase_times_reach_tensorboard_per_iteration(tmp_path):
    """A short run with tensorboard_dir set has `<phase>-time` scalars in its event file, and the
    times are per iteration: an interval's forward-backward total divided by its iterations fits
    inside the mean iteration time (the total itself would not: it spans four iterations)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    args = TINY + ["--training.train_iters=4", "--logging.log_interval=4", "--logging.timers_log_level=2",
                   f"--logging.tensorboard_dir={tb}", f"--logging.metrics_file={metrics}"]  # fmt: skip
    out = run_train(tmp_path, args).stdout
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
