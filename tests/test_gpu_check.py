"""scripts/gpu_check.py, the parts a CPU can check: its arguments, its refusal without CUDA, its
time limits, the figures it reads from each step's output and the summary table it writes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest


def _load_gpu_check():
    """scripts/gpu_check.py as a module, registered first (its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py")
    module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def test_without_cuda_it_stops_at_once_with_one_line(capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: gpu_check needs a CUDA device") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, says",
    [(["--only", "suite,benchmark"], "unknown step 'benchmark'"), (["--only", "resume"], "name train too"),
     (["--megatron-core", "nowhere.whl"], "nowhere.whl: no such file")],
)  # fmt: skip
def test_bad_arguments_are_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_steps_fit_the_bound():
    assert [s.name for s in gpu_check.STEPS] == ["suite", "bench", "train", "resume"]
    assert sum(s.limit_s for s in gpu_check.STEPS) <= 9 * 60  # about 8 minutes, each step cut at its limit


def test_a_step_past_its_limit_is_reported_not_waited_for(tmp_path):
    log = tmp_path / "slow.log"
    code, seconds = gpu_check.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], 2, log)
    assert code is None and seconds < 20
    result = gpu_check.result_of(gpu_check.Step("slow", 2, ""), code, seconds, log)
    assert not result.passed and result.timed_out and result.detail == "ran past its 2 s"


def test_the_summary_table_from_each_steps_output(tmp_path):
    suite = tmp_path / "suite.log"
    suite.write_text("....\n==== 650 passed, 12 skipped in 201.5s ====\n")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"results": {"124m": {"ratio": 1.031, "dtgpt": {"mfu": 0.412}}, "1.3b": {"ratio": None, "dtgpt": {}}}}))
    metrics = tmp_path / "resume.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i, "loss": 5.0 - i / 10, "tokens_per_s": 1000.0 * i}) + "\n" for i in range(11, 21)))
    assert gpu_check.suite_figures(suite) == "650 passed, 12 skipped in 201.5s"
    assert gpu_check.bench_figures(bench) == "124m: ratio 1.031, MFU 41.2%; 1.3b: failed"
    assert gpu_check.train_figures(metrics, 11) == "iterations 11-20, loss 3.9000 -> 3.0000, 16,000 tokens/s"
    failed_log = tmp_path / "bench.log"
    failed_log.write_text("...\nRuntimeError: CUDA out of memory\n")
    results = [
        gpu_check.Result("suite", True, 201.5, gpu_check.suite_figures(suite)),
        gpu_check.result_of(gpu_check.Step("bench", 150, ""), 1, 90.2, failed_log, gpu_check.bench_figures(bench)),
        gpu_check.Result("resume", True, 30.0, gpu_check.train_figures(metrics, 11)),
    ]
    env = gpu_check.Environment("2026-11-27T20:00:00+00:00", "NVIDIA H100 80GB HBM3", "2.11.0+cu130", "0.16.1")
    assert gpu_check.summary_table(env, results) == (
        "GPU check, 2026-11-27T20:00:00+00:00: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, megatron-core 0.16.1\n"
        "\n"
        "| step | result | seconds | figures |\n"
        "|---|---|---|---|\n"
        "| suite | passed | 202 | 650 passed, 12 skipped in 201.5s |\n"
        "| bench | FAILED | 90 | exit 1: RuntimeError: CUDA out of memory; 124m: ratio 1.031, MFU 41.2%; 1.3b: failed |\n"
        "| resume | passed | 30 | iterations 11-20, loss 3.9000 -> 3.0000, 16,000 tokens/s |\n"
        "\n"
        "2 of 3 steps passed\n"
    )
