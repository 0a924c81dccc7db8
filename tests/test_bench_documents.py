"""scripts/bench_documents.py: a tiny CPU run prints the ratio and writes it (no timing asserted)."""

import json
import os
import subprocess
import sys

import pytest

from tests.runs import REPO

pytestmark = pytest.mark.slow  # a benchmark run


def test_tiny_cpu_run_prints_the_ratio(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_documents.py"), "--layers", "1", "--hidden", "32", "--seq", "64",
           "--document-length", "16", "--iters", "2", "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    per_s = report["tokens_per_s"]
    assert per_s["causal"] > 0 and per_s["documents"] > 0
    assert report["ratio"] == pytest.approx(per_s["documents"] / per_s["causal"], rel=1e-12)
    assert report["documents_per_sample"] > 2  # the documents side really has documents to mask
    assert "documents / causal (tokens/s)" in proc.stdout
    assert report["varlen_over_masked"] == pytest.approx(per_s["documents"] / per_s["documents_masked"], rel=1e-12)
    assert "documents / documents_masked (tokens/s)" in proc.stdout
