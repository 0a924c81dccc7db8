"""Timers and the profiler through real train.py runs."""

import pytest

from tests.runs import TINY, run_train

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
