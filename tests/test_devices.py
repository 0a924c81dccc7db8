"""Which device a rank trains on (dtgpt/config/devices.py): CUDA only where every local rank has a
GPU of its own; anything else asked of CUDA is one `error:` line, exit 2, before any process
group, printed once under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtgpt.config import ConfigError
from dtgpt.config.devices import choose_device

REPO = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(
    "requested, local_ranks, gpus, expected",
    [
        ("auto", 1, 0, "cpu"), ("auto", 8, 0, "cpu"), ("auto", 1, 1, "cuda"), ("auto", 8, 8, "cuda"),
        ("auto", 4, 8, "cuda"), ("cpu", 8, 1, "cpu"), ("cpu", 1, 8, "cpu"), ("cuda", 2, 2, "cuda"),
    ],
)  # fmt: skip
def test_each_local_rank_gets_a_gpu_of_its_own_or_the_cpu(requested, local_ranks, gpus, expected):
    assert choose_device(requested, local_ranks, gpus) == expected


@pytest.mark.parametrize("requested, local_ranks, gpus", [("auto", 8, 1), ("cuda", 8, 1), ("cuda", 2, 1), ("auto", 3, 2)])
def test_more_local_ranks_than_gpus_names_both_counts_and_the_fix(requested, local_ranks, gpus):
    with pytest.raises(ConfigError) as e:
        choose_device(requested, local_ranks, gpus)
    message = str(e.value)
    assert f"{local_ranks} local ranks but {gpus} CUDA device" in message
    assert f"training.device={requested!r}" in message and "--training.device=cpu" in message
    assert "\n" not in message


def test_cuda_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"training.device='cuda' but this machine has no CUDA device for its 2 local ranks: --training.device=cpu"):
        choose_device("cuda", 2, 0)


def _train(prefix: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*prefix, "train.py", "--config", "configs/debug.toml", "--training.device=cuda"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line_and_exit_2():
    proc = _train([sys.executable])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "error: training.device='cuda' but this machine has no CUDA device for its 1 local rank: "
        "--training.device=cpu runs the same mesh on CPU (gloo)"
    ]


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_cuda_without_cuda_under_torchrun_is_said_once_by_one_rank():
    proc = _train([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: training.device='cuda' but this machine has no CUDA device for its 2 local ranks: "
        "--training.device=cpu runs the same mesh on CPU (gloo)"
    ], proc.stderr[-3000:]
    before_report = proc.stderr.split(errors[0])[0]
    assert "Traceback" not in before_report  # no worker's traceback
    # the first worker to stop refused with 2 (torchrun stops the others and adds its report after
    # any worker exit but 0: dtgpt/error_once.py)
    assert proc.returncode != 0
    assert "exitcode  : 2" in proc.stderr.split("Root Cause")[1]
