"""scripts/bench_moe.py: a tiny run writes well-formed results, and its two paths compute the same.

No timing is asserted: only that both paths ran and what they computed agrees.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.runs import REPO, load_script

BENCH = REPO / "scripts" / "bench_moe.py"
TINY = ["--device", "cpu", "--tokens", "24", "--experts", "4", "--topk", "2", "--hidden", "8", "--ffn", "12", "--warmup", "0", "--iters", "1"]


@pytest.mark.slow
def test_tiny_run_writes_json_and_the_ratio_line(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(BENCH), *TINY, "--json", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    grouped, loop = report["results"]["grouped"], report["results"]["loop"]
    assert len(grouped["iter_ms"]) == len(loop["iter_ms"]) == 2  # 1 iteration x 2 rounds
    assert grouped["tokens_per_s"] > 0 and loop["tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(grouped["tokens_per_s"] / loop["tokens_per_s"], rel=1e-12)
    assert report["max_abs_diff"] == 0.0  # fp32: the loop is the grouped path's exact oracle
    assert sum(report["tokens_per_expert"]) == 24 * 2 and report["shape"]["dtype"] == "fp32"
    assert f"grouped / loop (tokens/s): {report['ratio']:.3f}" in proc.stdout


def test_the_two_paths_compute_equal_results():
    bench = load_script("bench_moe")
    args = bench.parse_args(TINY)
    device = torch.device("cpu")
    grouped, loop = bench.build(args, True, device), bench.build(args, False, device)
    assert grouped.grouped_gemm and not loop.grouped_gemm
    x, counts = bench.routed_inputs(args, device)
    grad = torch.randn_like(x)
    assert bench.compare(grouped, loop, x, counts, grad) == 0.0
    with torch.no_grad():  # the comparison can see a difference
        loop.fc2_weight[0, 0, 0] += 1e-3
    assert bench.compare(grouped, loop, x, counts, grad) > 0.0


def test_bad_arguments_are_one_error_line(capsys):
    bench = load_script("bench_moe")
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--topk", "9", "--experts", "8"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].endswith("error: --topk 9 must be at most --experts 8")


def test_the_two_paths_of_a_whole_layer_compute_equal_results():
    bench = load_script("bench_moe")
    args = bench.parse_args([*TINY, "--layer"])
    device = torch.device("cpu")
    grouped, loop = bench.build_layer(args, True, device), bench.build_layer(args, False, device)
    assert grouped.experts.grouped_gemm and not loop.experts.grouped_gemm
    x = torch.randn(1, args.tokens, args.hidden)
    grad = torch.randn_like(x)
    assert bench.compare(grouped, loop, x, None, grad, bench.layer_step) < 1e-6
    with torch.no_grad():
        loop.router.weight[0, 0] += 1.0
    assert bench.compare(grouped, loop, x, None, grad, bench.layer_step) > 1e-6
