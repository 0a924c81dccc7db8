"""Run train.py as one process or under torchrun and read back its per-iteration metrics (and, for
the parity oracle, the parameters its checkpoints hold)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "train.py")
BATCH_WORKER = str(REPO / "tests" / "batch_worker.py")

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


def run_args(tmp_path: Path, args: list[str], name: str, base: list[str], save_interval: int) -> list[str]:
    """train.py's arguments for a run of base + args that train_run can read back."""
    metrics, ckpt = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ckpt"
    return base + args + [f"--logging.metrics_file={metrics}", f"--checkpoint.save={ckpt}", f"--checkpoint.save_interval={save_interval}"]


def read_run(tmp_path: Path, name: str) -> dict:
    """A finished run's per-iteration metrics by key ("loss", "grad_norm", "skipped",
    "global_batch_size", ...), "params": {iteration: {name: full fp32 tensor}} for the final
    iteration (and every save_interval) and "heads", the model's attention heads. The parameters
    come from the run's own checkpoints, read whole by name (every rank's shard): no extra launch."""
    from dtgpt.checkpoint.export import read_config, read_sections  # torch: only where needed

    records = read_metrics(tmp_path / f"{name}.jsonl")
    params = {}
    for directory in sorted((tmp_path / f"{name}_ckpt").glob("iter_*")):
        model = read_sections(directory, ("model",))["model"]
        params[int(directory.name.split("_")[1])] = {k: v.float() for k, v in model.items()}
    heads = read_config(directory).model.num_attention_heads
    return {**{key: [r[key] for r in records] for key in records[0]}, "params": params, "heads": heads}


def train_run(
    tmp_path: Path,
    args: list[str],
    nproc: int = 1,
    name: str = "run",
    base: list[str] = TINY,
    save_interval: int = 0,
    **kw,
) -> dict:
    """One run of base + args, launched on its own; read_run's dict."""
    run_train(tmp_path, run_args(tmp_path, args, name, base, save_interval), nproc=nproc, name=name, **kw)
    return read_run(tmp_path, name)


@dataclass
class Run:
    """One run of a batch (train_runs): base + args on nproc ranks, in its own directory."""

    key: str
    directory: Path
    args: list[str]
    nproc: int = 1
    base: list[str] = field(default_factory=lambda: TINY)
    save_interval: int = 0
    seconds: float = 0.0
    """its share of its launch's timeout (0: SECONDS_PER_RUN)"""


# A tiny run takes seconds (under 20 s with 4 ranks on 2 loaded cores); a hung one stops at
# the collective timeout, so the bound only has to cover the slowest healthy batch.
SECONDS_PER_RUN = 120


@dataclass
class Command:
    """One train.py run of a batch with arguments of its own (launch_commands), run in directory."""

    key: str
    directory: Path
    argv: list[str]
    nproc: int = 1
    seconds: float = SECONDS_PER_RUN
    """its share of its launch's timeout"""
    call: str = ""
    """"module:function" to call with argv in place of train.py's entry (tests/batch_worker.py)"""


@dataclass
class Finished:
    """A batched run's outcome: failure is empty when it exited 0, else what to show; output is
    what every rank printed during it (stdout and stderr), rank by rank."""

    failure: str
    output: str

    def checked(self) -> str:
        """The output; a run that failed fails the test with its log."""
        if self.failure:
            pytest.fail(self.failure, pytrace=False)
        return self.output


def train_runs(runs: list[Run]) -> dict[str, dict | str]:
    """The runs, launched together: one launch per rank count (tests/batch_worker.py), which pays
    the processes' start-up once instead of once per run. Returns read_run's dict by key, with
    "output": what its ranks printed, or for a run that failed or never ran (an earlier one in its
    launch raised) the text saying so."""
    commands = [Command(r.key, r.directory, run_args(r.directory, r.args, r.key, r.base, r.save_interval), r.nproc,
                        r.seconds or SECONDS_PER_RUN) for r in runs]  # fmt: skip
    finished = launch_commands(sorted(commands, key=lambda c: c.nproc))
    return {r.key: finished[r.key].failure or {**read_run(r.directory, r.key), "output": finished[r.key].output} for r in runs}


def launch_commands(commands: list[Command]) -> dict[str, Finished]:
    """The commands, one launch per rank count, the rank counts in the order they first appear
    and each launch's commands in the order given: a launch can hold a run and then its resume,
    and a later launch resume what an earlier one saved. Finished by key."""
    finished: dict[str, Finished] = {}
    for nproc in dict.fromkeys(c.nproc for c in commands):
        finished.update(_launch([c for c in commands if c.nproc == nproc], nproc))
    return finished


def _launch(commands: list[Command], nproc: int) -> dict[str, Finished]:
    workdir = commands[0].directory
    spec = [{"key": c.key, "cwd": str(c.directory), "argv": c.argv, **({"call": c.call} if c.call else {})} for c in commands]
    (workdir / "runs.json").write_text(json.dumps(spec))
    if nproc == 1:
        cmd = [sys.executable, BATCH_WORKER]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", BATCH_WORKER]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # stderr into stdout: each run's error lines stay in its section of the log
    proc = subprocess.run(
        cmd + [str(workdir / "runs.json")], cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=sum(c.seconds for c in commands),
    )  # fmt: skip
    log = proc.stdout
    (workdir / "launch.log").write_text(log)
    finished: dict[str, Finished] = {}
    for c in commands:
        rc_file = c.directory / f"{c.key}.rc"
        outputs = [c.directory / f"{c.key}.rank{rank}.out" for rank in range(nproc)]
        output = "".join(path.read_text() for path in outputs if path.exists())
        if not rc_file.exists():
            failure = f"{c.key} did not finish in its launch of {len(commands)} runs on {nproc} ranks (exit {proc.returncode}):\n{log[-6000:]}"
        elif rc_file.read_text() != "0":
            failure = f"{c.key} exited {rc_file.read_text()}:\n{_section(log, c.key)[-4000:]}"
        else:
            failure = ""
        finished[c.key] = Finished(failure, output)
    return finished


def _section(log: str, key: str) -> str:
    """The part of a launch's log that one run printed (from its first rank's header to the
    first header of another run)."""
    header = f"=== run {key} ==="
    start = log.find(header)
    other = re.compile(rf"^=== run (?!{re.escape(key)} ===)", re.M).search(log, start)
    return log[start : other.start() if other else None]


def selected_cases(request, test) -> list[str]:
    """The ids of test's parametrized cases this session runs (after -k, without the skipped):
    what a module fixture launches together."""
    return [
        item.callspec.id if hasattr(item, "callspec") else item.name
        for item in request.session.items
        if getattr(item, "function", None) is test and not item.get_closest_marker("skip")
    ]


def result_of(results: dict[str, dict | str], key: str) -> dict:
    """A batched run's dict; a run that failed fails the test with its log."""
    got = results[key]
    if isinstance(got, str):
        pytest.fail(got, pytrace=False)
    return got


def load_script(name: str):
    """scripts/<name>.py as a module (its main() and helpers, without a subprocess)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_worker(script: str, nproc: int, out: Path, timeout: int = 300) -> None:
    """Run tests/<script> under torchrun on `nproc` gloo ranks with `out` as its argument (and
    working directory); fails the test with the output's tail unless it exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(REPO / "tests" / script), str(out)]
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
