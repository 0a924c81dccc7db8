"""Which device a rank trains on (dtgpt/config/devices.py): CUDA only where every local rank has a
GPU of its own; anything else asked of CUDA is one `error:` line, exit 2, before any process
group, printed once under torchrun."""

from __future__ import annotations

import ast
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


@pytest.mark.parametrize("requested", ["cuda"])  # a request, not a device this test uses
def test_cuda_without_a_gpu_is_refused_with_the_fix(requested):
    with pytest.raises(ConfigError, match=r"training.device='cuda' but this machine has no CUDA device for its 2 local ranks: --training.device=cpu"):
        choose_device(requested, 2, 0)


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


# --- where the tests run (tests/conftest.py) ------------------------------------------------------


def test_a_test_runs_with_cuda_hidden_from_itself_and_its_processes():
    """The suite's expectations are CPU numerics: without the `cuda` marker a test sees no GPU,
    and neither does a train.py or torchrun it starts."""
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    from dtgpt.distributed import resolve_device

    assert resolve_device("auto", 0, 8) == torch.device("cpu")


def _reaches_for_cuda(node: ast.AST) -> bool:
    """A body that puts something on CUDA: a "cuda" / "cuda:N" device, `.cuda()`, or torch.cuda
    calls other than the stand-ins oracle patches install (current_device, synchronize)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and (sub.value == "cuda" or sub.value.startswith("cuda:")):
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "cuda" and isinstance(sub.ctx, ast.Load):
            parent_call = any(isinstance(c, ast.Call) and c.func is sub for c in ast.walk(node))
            if parent_call:
                return True
    return False


def _marked_cuda(decorators: list[ast.expr]) -> bool:
    return any("mark.cuda" in ast.unparse(d) for d in decorators)


def unmarked_cuda_tests(source: str) -> list[str]:
    """The test functions of a test module that reach for CUDA without the `cuda` marker: they
    would run under the CPU pin (a device mix, or CUDA numerics checked against CPU ones)."""
    tree = ast.parse(source)
    module_marked = any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets) and "mark.cuda" in ast.unparse(n.value)
        for n in tree.body
    )
    return [
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
        and not module_marked and not _marked_cuda(n.decorator_list)
        and any(_reaches_for_cuda(statement) for statement in n.body)
    ]  # fmt: skip


def test_the_pin_check_finds_a_test_that_reaches_for_cuda_unmarked():
    source = (
        "import pytest, torch\n"
        "def test_a(): assert torch.ones(1, device='cuda').sum() == 1\n"
        "def test_b(): torch.ones(1).cuda()\n"
        "@pytest.mark.cuda\ndef test_c(): torch.ones(1, device='cuda')\n"
        "def test_d(): run(['--training.device=cuda'])\n"
    )
    assert unmarked_cuda_tests(source) == ["test_a", "test_b"]


def test_every_test_that_reaches_for_cuda_is_marked_cuda():
    found = {
        str(path.relative_to(REPO)): names
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        if (names := unmarked_cuda_tests(path.read_text()))
    }
    assert found == {}, f"mark these @pytest.mark.cuda (they run with CUDA hidden otherwise): {found}"
