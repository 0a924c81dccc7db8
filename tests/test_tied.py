"""The tied embedding split across pipeline stages stays one weight (dtgpt/parallel/tied.py)."""

import os
import subprocess
import sys

import pytest

from tests.runs import REPO

pytestmark = pytest.mark.slow  # a 2-rank launch


def test_library_api_keeps_the_copies_equal_and_the_check_catches_a_drift(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(REPO / "tests/tied_worker.py")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: copies equal after 3 steps" in proc.stdout
        assert f"rank {rank}: iteration 4: the first and last pipeline stages' copies of the tied word embedding differ by up to" in proc.stdout
