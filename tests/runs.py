"""Run train.py as one process or under torchrun and read back its per-iteration metrics (and, for
the parity oracle, the parameters its checkpoints hold)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "train.py")

# A tiny fp32 GPT on deterministic mock data: every layout must train it identically.
TINY = [
    "--model.num_layers=4",
    "--model.hidden_size=64",
    "--model.num_attention_heads=4",
    "--model.seq_length=32",
    "--model.hidden_dropout=0.0",
    "--model.attention_dropout=0.0",
    "--model.make_vocab_size_divisible_by=64",
    "--training.micro_batch_size=1",
    "--training.global_batch_size=8",
    "--training.train_iters=10",
    "--optimizer.lr=3e-3",
    "--optimizer.lr_warmup_iters=2",
    "--optimizer.lr_decay_style=cosine",
    "--data.mock_data=true",
    "--data.tokenizer_type=NullTokenizer",
    "--data.vocab_size=128",
    "--data.num_workers=0",
    "--eval.eval_iters=0",
    "--logging.log_interval=5",
]


def run_train(
    tmp_path: Path,
    args: list[str],
    nproc: int = 1,
    name: str = "run",
    check: bool = True,
    timeout: float = 300,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run train.py (one process when nproc == 1, else torchrun --standalone)."""
    if nproc == 1:
        cmd = [sys.executable, TRAIN]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", TRAIN]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd + args, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd + args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(
    tmp_path: Path, args: list[str], nproc: int = 1, name: str = "run", base: list[str] = TINY, **kw
) -> list[float]:
    """Per-iteration losses of a run of base (TINY by default) + args."""
    metrics = tmp_path / f"{name}.jsonl"
    run_train(tmp_path, base + args + [f"--logging.metrics_file={metrics}"], nproc=nproc, name=name, **kw)
    return [r["loss"] for r in read_metrics(metrics)]


def train_run(
    tmp_path: Path,
    args: list[str],
    nproc: int = 1,
    name: str = "run",
    base: list[str] = TINY,
    save_interval: int = 0,
    **kw,
) -> dict:
    """One run of base + args: its per-iteration metrics by key ("loss", "grad_norm", "skipped",
    "global_batch_size", ...), "params": {iteration: {name: full fp32 tensor}} for the final
    iteration (and every save_interval) and "heads", the model's attention heads. The parameters
    come from the run's own checkpoints, read whole by name (every rank's shard): no extra launch."""
    from dtgpt.checkpoint.export import read_config, read_sections  # torch: only where needed

    metrics, ckpt = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ckpt"
    saving = [f"--checkpoint.save={ckpt}", f"--checkpoint.save_interval={save_interval}"]
    run_train(tmp_path, base + args + [f"--logging.metrics_file={metrics}", *saving], nproc=nproc, name=name, **kw)
    records = read_metrics(metrics)
    params = {}
    for directory in sorted(ckpt.glob("iter_*")):
        model = read_sections(directory, ("model",))["model"]
        params[int(directory.name.split("_")[1])] = {k: v.float() for k, v in model.items()}
    heads = read_config(directory).model.num_attention_heads
    return {**{key: [r[key] for r in records] for key in records[0]}, "params": params, "heads": heads}


def load_script(name: str):
    """scripts/<name>.py as a module (its main() and helpers, without a subprocess)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
