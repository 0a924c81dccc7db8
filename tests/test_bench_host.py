"""scripts/bench_host.py: at nil width in bf16, dtgpt dispatches no more aten ops per step than
the plain loop (the CPU proxy for kernels per step). Op counts, not times: no timing is asserted."""

import importlib.util

import pytest

from dtgpt.distributed import shutdown
from tests.runs import REPO, load_script


def load_bench_host():
    spec = importlib.util.spec_from_file_location("dtgpt_bench_host", REPO / "scripts" / "bench_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bf16_step_dispatches_no_more_ops_than_the_plain_loop():
    bench_host = load_bench_host()
    try:
        result = bench_host.measure("bf16", steps=1, rounds=1, warmup=1, vocab=256)
    finally:
        shutdown(clean=False)
    # Measured 0.89 (FSDP's cast of one rank: 1.13, with 2.6x the host time).
    assert result["ratio"]["ops"] <= 1.05, result
    assert result["dtgpt"]["ms"] > 0 and result["plain"]["ms"] > 0


@pytest.mark.parametrize(
    "script, argv, says",
    [
        ("bench_host", ["--precision", "fp8"], "--precision='fp8': 'fp8' is not bf16 or fp32"),  # ran fp32 as "fp8"
        ("bench_host", ["--steps", "0"], "--steps=0 must be 1 or more"),  # divided by zero
        ("bench_host", ["--rounds", "0"], "--rounds=0 must be 1 or more"),  # the median of nothing
        ("bench_host", ["--vocab", "0"], "--vocab=0 must be 1 or more"),  # a config traceback
        ("bench_host_mesh", ["--layers", "two,six"], "--layers='two,six' needs two or more distinct even counts"),
        ("bench_host_mesh", ["--rounds", "0"], "--rounds=0 must be 1 or more"),
        ("bench_host_mesh", ["--by-name", "-1"], "--by-name=-1 0 or more"),  # printed all but the last name
        ("bench_loss_ops", ["--tokens", "0"], "--tokens=0 must be 1 or more"),  # a NaN difference
        ("bench_loss_ops", ["--vocab", "0"], "--vocab=0 must be 1 or more"),
    ],
)
def test_bench_options_out_of_range_are_one_error_line(capsys, script, argv, says):
    module = load_script(script)
    with pytest.raises(SystemExit) as e:
        (module.parse_args if script == "bench_host_mesh" else module.main)(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err.splitlines()[-1]
