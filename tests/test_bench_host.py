"""scripts/bench_host.py: at nil width in bf16, dtgpt dispatches no more aten ops per step than
the plain loop (the CPU proxy for kernels per step). Op counts, not times: no timing is asserted."""

import importlib.util

import pytest

from dtgpt.distributed import shutdown
from tests.runs import REPO


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
