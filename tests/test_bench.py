"""scripts/bench.py: the CPU smoke run writes its results, and its reference is dtgpt's math.

No timing is asserted: only that both sides ran, and that the comparison is apples to apples.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.runs import REPO

BENCH = REPO / "scripts" / "bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("dtgpt_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_cpu_run_writes_json(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(BENCH), "--sizes", "tiny", "--device", "cpu", "--iters", "2", "--warmup", "1", "--profile", "--json", str(out)]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["complete"] is True and report["sizes"] == ["tiny"]  # rewritten after each size; this was the last
    tiny = report["results"]["tiny"]
    dtgpt, reference = tiny["dtgpt"]["tokens_per_s"], tiny["reference"]["tokens_per_s"]
    assert dtgpt > 0 and reference > 0
    assert tiny["ratio"] == pytest.approx(dtgpt / reference, rel=1e-12)
    assert tiny["dtgpt"]["mfu"] is None and tiny["reference"]["mfu"] is None  # no peak for a CPU
    assert tiny["tokens_per_iter"] == 4 * 64 and tiny["config"]["padded_vocab_size"] == 50304
    assert report["environment"]["torch"] == torch.__version__
    assert "flops_per_token" in report["flop_formula"]
    assert "dtgpt / reference (tokens/s)" in proc.stdout and "torch " + torch.__version__ in proc.stdout
    for side in ("dtgpt", "reference"):  # --profile: on a CPU, aten ops and the optimizer's host time per step
        profile = tiny[side]["profile"]
        assert profile["kernel_kind"] == "aten ops (CPU)" and profile["kernels"] > 100 and profile["busy"] is None
        assert profile["optimizer_ms"] > 0
    assert "aten ops (CPU)/step" in proc.stdout


def test_reference_computes_dtgpt_losses_from_the_same_weights():
    """fp32 on CPU: the same weights and batches give the same losses, step after step."""
    bench = load_bench()
    from reference_gpt import copy_dtgpt_weights  # scripts/, put on the path by bench.py

    cfg = bench.bench_config("tiny", "cpu", bf16=False)
    device = torch.device("cpu")
    dtgpt_step, dtgpt_model = bench.dtgpt_step(cfg, device)
    reference_step, reference_model = bench.reference_step(cfg, device)
    batches = bench.make_batches(cfg, device, 3, on_host=False)
    tokens, labels = batches[0][:, :-1], batches[0][:, 1:]

    copy_dtgpt_weights(dtgpt_model, reference_model)
    # The check has teeth: copying dtgpt's head-by-head QKV rows without regrouping them
    # (or not copying at all) moves the loss far more than the tolerance below.
    with torch.no_grad():
        copied = reference_model(tokens, labels).item()
        for name, block in dtgpt_model.layers.items():
            reference_model.blocks[int(name)].qkv.weight.copy_(block.attention.qkv.weight)
        misordered = reference_model(tokens, labels).item()
    assert abs(misordered - copied) > 1e-4 * abs(copied)
    copy_dtgpt_weights(dtgpt_model, reference_model)

    dtgpt_losses = [dtgpt_step(b) for b in batches]
    reference_losses = [reference_step(b) for b in batches]
    assert reference_losses[0] == pytest.approx(dtgpt_losses[0], rel=1e-5)
    assert copied == pytest.approx(dtgpt_losses[0], rel=1e-5)
    # The same AdamW, weight-decay groups and clipping: later steps agree too.
    assert reference_losses == pytest.approx(dtgpt_losses, rel=1e-5)
