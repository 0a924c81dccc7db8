"""The launch scripts plan first: Megatron's 175B script with train.py, and the Slurm batch
script, run with fake torchrun, scontrol and srun (all marked slow: `make test`)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plans import ENV, REPO


def _fake_tool(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _run_script(script: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    full = {**ENV, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(REPO / script), *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=300)


PATHS = ["/ckpt", "/tb", "/vocab.json", "/merges.txt", "0.3 /data/a_text_document 0.7 /data/b_text_document"]


@pytest.mark.slow
def test_launch_script_plans_then_runs_torchrun(tmp_path):
    """Megatron's 175B script with train.py: its arrays of Megatron flags, planned first."""
    record = tmp_path / "torchrun.args"
    torchrun = _fake_tool(tmp_path, "torchrun", f'printf "%s\\n" "$@" > {record}')
    proc = _run_script("scripts/train_gpt3_175b_distributed.sh", PATHS, {"TORCHRUN": str(torchrun), "NODE_RANK": "3"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1,463,270,400" in proc.stdout  # the plan was printed first (pp rank 0's parameters, 51,200 vocabulary rows)
    args = record.read_text().splitlines()
    assert args[:10] == ["--nproc_per_node", "8", "--nnodes", "16", "--node_rank", "3", "--master_addr", "localhost",
                         "--master_port", "6000"]  # fmt: skip
    assert args[10] == str(REPO / "train.py")
    train_args = args[11:]
    assert train_args[:12] == ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
                               "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto"]  # fmt: skip
    assert train_args[train_args.index("--rampup-batch-size") :][:4] == ["--rampup-batch-size", "16", "16", "5859375"]
    assert train_args[train_args.index("--data-path") :][:5] == ["--data-path", *PATHS[4].split()]
    assert train_args[-14:] == ["--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
                                "--save", "/ckpt", "--load", "/ckpt", "--eval-iters", "10", "--tensorboard-dir", "/tb"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "env, extra, code",
    [
        ({}, ["--group-query-attention", "--num-query-groups", "5"], 2),  # 5 key/value heads over tp 8
        ({"NUM_NODES": "3"}, [], 2),  # 24 GPUs for pp 16 x tp 8
        ({"GPU_MEMORY_GIB": "40"}, [], 1),
    ],
    ids=["heads", "world-size", "memory"],
)
def test_launch_script_refuses_a_layout_the_planner_rejects(tmp_path, env, extra, code):
    record = tmp_path / "launched"
    torchrun = _fake_tool(tmp_path, "torchrun", f"touch {record}")
    proc = _run_script("scripts/train_gpt3_175b_distributed.sh", PATHS + extra, {"TORCHRUN": str(torchrun), **env})
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "refusing to launch" in proc.stderr and not record.exists()


@pytest.mark.slow
def test_sbatch_plans_then_srun_torchrun_with_c10d_rendezvous(tmp_path):
    _fake_tool(tmp_path, "scontrol", 'printf "gpu-node-017\\ngpu-node-018\\n"')
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "DTGPT_DRY_RUN": "1", "DTGPT_REPO": str(REPO),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-node-[017-018]",
           "GPUS_PER_NODE": "4", "CONFIG": str(REPO / "configs" / "debug_3d.toml")}  # fmt: skip
    proc = _run_script("scripts/slurm/gpt3_175b.sbatch", PATHS, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launch = proc.stdout.strip().splitlines()[-1]
    assert launch.startswith("srun --nodes 2 --ntasks-per-node 1")
    assert "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint gpu-node-017:29500 --rdzv-id 4242" in launch
    assert "--checkpoint.save=/ckpt" in launch
    refused = _run_script("scripts/slurm/gpt3_175b.sbatch", PATHS + ["--parallel.tensor_model_parallel_size=3"], env)
    assert refused.returncode == 2 and "srun" not in refused.stdout


