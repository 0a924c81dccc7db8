"""Every command in the README runs as written (shortened to a few iterations), so the README
cannot rot; and none of them prints a warning we have not accounted for. A command that reads
what another writes (checkpoints/debug, a converted checkpoint, preprocessed data) runs after it.

The commands are read from the README's code blocks. A command added to the README without an
entry in RUNS below fails `test_every_readme_command_has_a_run`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import REPO

README = REPO / "README.md"
PROGRAMS = ("make ", "python ", "torchrun ")

SHORT_RUN = ["--training.train_iters=4", "--eval.eval_interval=2", "--eval.eval_iters=1", "--logging.log_interval=2"]
PREPROCESS = (
    "python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --tokenizer-type ByteTokenizer --append-eod"
)
TRAIN_ON_IT = (
    "python train.py --config configs/debug.toml --data.data_path=data/corpus_text_document "
    "--checkpoint.save=checkpoints/corpus --checkpoint.load=checkpoints/corpus"
)
TO_MEGATRON = "python scripts/convert_checkpoint.py to-megatron checkpoints/debug checkpoints/megatron_debug"
FROM_MEGATRON = (
    "python scripts/convert_checkpoint.py from-megatron checkpoints/megatron_debug checkpoints/from_megatron --config configs/debug.toml"
)
TO_TORCH = "python scripts/convert_checkpoint.py to-torch checkpoints/debug checkpoints/debug.pt"
FROM_TORCH = "python scripts/convert_checkpoint.py from-torch checkpoints/debug.pt checkpoints/from_torch"
TO_HF = "python scripts/convert_checkpoint.py to-hf checkpoints/debug checkpoints/hf_debug"
FROM_HF = "python scripts/convert_checkpoint.py from-hf checkpoints/hf_debug checkpoints/from_hf"
GENERATE = "python scripts/generate.py checkpoints/debug --prompt 'def ' --max-new-tokens 40 --temperature 0.8 --top-k 20"
MEGATRON_FLAGS = (
    "python train.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 10 --lr 3e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
    "--use-mcore-models"
)
RUNS: dict[str, list[str] | None] = {
    # README command (as extracted) -> arguments appended to shorten it; None: not run here
    "make train": SHORT_RUN,
    "make test": None,  # the test suite itself: CI runs it
    "make test-fast": None,  # the suite's fast subset
    "make test-oracle": None,  # the oracle tests on megatron-core 0.19 (a 5 GB venv: run by hand)
    "python train.py --config configs/debug.toml": SHORT_RUN,
    "torchrun --nproc-per-node 8 train.py --config configs/debug_3d.toml": SHORT_RUN,
    "python train.py --config configs/gpt3_175b.toml --print-config": [],
    "python train.py --config configs/gpt3_175b.toml --dry-run": [],
    "python scripts/plan.py --config configs/debug_3d.toml --world-size 8 --check": [],
    "python scripts/plan.py --config configs/llama3_8b.toml --world-size 8 --fused-attention --gpu-memory-gib 141 --check": [],
    "torchrun --nproc-per-node 8 train.py --config configs/gpt3_175b.toml": ["--training.train_iters=4"],
    "torchrun --nproc-per-node 2 examples/simple_train_loop.py": [],
    MEGATRON_FLAGS: [],  # ten iterations as written
    # the launcher that replaces a dead worker alone (docs/faults.md), on a run without a fault
    "python -m dtgpt.run --standalone --nproc-per-node 2 --max-restarts 2 train.py --config configs/debug.toml "
    "--parallel.data_parallel_replicate_size=2": SHORT_RUN,
    # your data, checkpoints in and out, sampling: each reads what `make train` or the one before leaves
    PREPROCESS: [],
    TRAIN_ON_IT: SHORT_RUN,
    TO_MEGATRON: [],
    FROM_MEGATRON: [],
    TO_TORCH: [],
    FROM_TORCH: [],
    TO_HF: [],
    FROM_HF: [],
    GENERATE: [],
}
NEEDS = {TRAIN_ON_IT: [PREPROCESS], FROM_MEGATRON: [TO_MEGATRON], FROM_TORCH: [TO_TORCH], FROM_HF: [TO_HF]}
"""README commands that read what another one writes: that one runs first, in the same folder."""
OUTPUTS = {
    PREPROCESS: ["data/corpus_text_document.bin", "data/corpus_text_document.idx"],
    TRAIN_ON_IT: ["checkpoints/corpus/iter_0000004/complete"],
    TO_MEGATRON: ["checkpoints/megatron_debug/iter_0000004/common.pt", "checkpoints/megatron_debug/latest_checkpointed_iteration.txt"],
    FROM_MEGATRON: ["checkpoints/from_megatron/iter_0000004/complete"],
    TO_TORCH: ["checkpoints/debug.pt"],
    FROM_TORCH: ["checkpoints/from_torch/iter_0000004/complete"],
    TO_HF: ["checkpoints/hf_debug/model.safetensors", "checkpoints/hf_debug/config.json", "checkpoints/hf_debug/tokenizer.json"],
    FROM_HF: ["checkpoints/from_hf/iter_0000000/complete"],
}
"""What a command must leave behind (besides exiting 0 without a warning)."""
DEBUG_RUNS = ("make train", "python train.py --config configs/debug.toml")
"""The commands that leave checkpoints/debug, which the others read (trained once: trained_debug)."""

WARNING = re.compile(r"warn", re.IGNORECASE)
EXPLAINED_WARNINGS = (
    # the planner's finding on the 175B config, its reason to exist (docs/plan.md, "warnings")
    "WARNING: large pipeline bubble during ramp-up",
)
"""Substrings of warnings that are understood and documented."""


def readme_commands() -> list[str]:
    """Shell commands of the README's code blocks: continuation lines joined, comments dropped."""
    commands, in_block = [], False
    lines = iter(README.read_text().splitlines())
    for line in lines:
        if line.startswith("```"):
            in_block = not in_block
            continue
        if not in_block or not line.startswith(PROGRAMS):
            continue
        while line.rstrip().endswith("\\"):
            line = line.rstrip()[:-1] + " " + next(lines).strip()
        commands.append(shlex.join(shlex.split(line, comments=True)))
    return commands


def run_key(command: str) -> str:
    """The RUNS entry of a command: itself, or its first line for the long debugging command."""
    return command if command in RUNS else next((key for key in RUNS if command.startswith(key + " --")), command)


def test_every_readme_command_has_a_run():
    commands = readme_commands()
    assert len(commands) >= 8, commands
    missing = [c for c in commands if run_key(c) not in RUNS]
    assert not missing, f"README commands without a run in tests/test_readme.py: {missing}"


def workspace(tmp_path: Path) -> Path:
    """A folder where relative paths of a command (configs/, checkpoints/, runs/) resolve as in a
    checkout, while what the command writes stays out of the real one; with a `corpus.jsonl`."""
    for name in ("train.py", "configs", "scripts", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    rng = random.Random(0)
    words = "the rank reads its tokens and saves a checkpoint while every layout trains one model".split()
    texts = (" ".join(rng.choices(words, k=rng.randint(20, 80))) for _ in range(300))
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return tmp_path


def crash_stacks(output: str) -> str:
    """The Python stacks a crashed rank printed (faulthandler's, which dtgpt.cli enables): under
    torchrun they come long before the tail a failure shows, which holds the launcher's report."""
    start = output.find("Fatal Python error")
    return "" if start < 0 else output[start : start + 4000] + "\n[...]\n"


def run_readme_command(command: str, where: Path) -> subprocess.CompletedProcess:
    """`command` as written plus its RUNS arguments, in `where`, with the venv activated."""
    argv = as_argv(command) + RUNS[run_key(command)]
    argv = [a.replace("/tmp/ckpt", str(where / "ckpt")) for a in argv]  # keep runs apart
    return subprocess.run(argv, cwd=where, env=activated_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def trained_debug(tmp_path_factory) -> Path:
    """checkpoints/debug as `make train` leaves it (shortened), for the commands that read it."""
    where = workspace(tmp_path_factory.mktemp("trained_debug"))
    proc = run_readme_command(DEBUG_RUNS[1], where)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return where / "checkpoints/debug"


def as_argv(command: str) -> list[str]:
    """The command's argv as written (run with the venv activated: see activated_env), `make
    train` replaced by the recipe make would run; torchrun runs standalone, on one machine."""
    if command.startswith("make "):
        recipe = subprocess.run(["make", "-s", "-n", "-C", str(REPO), command.split()[1]], capture_output=True, text=True)
        lines = [ln for ln in recipe.stdout.splitlines() if "train.py" in ln]
        assert lines, recipe.stdout + recipe.stderr
        argv = shlex.split(lines[-1])
        return [sys.executable] + argv[1:]  # the venv's python is this one
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        return argv[:1] + ["--standalone"] + argv[1:]
    return argv


def activated_env() -> dict[str, str]:
    """The environment after `source .venv/bin/activate`, as the README asks: the venv's bin first
    on PATH (its python and torchrun), VIRTUAL_ENV set."""
    venv_bin = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": venv_bin + os.pathsep + os.environ["PATH"], "VIRTUAL_ENV": os.path.dirname(venv_bin),
            "OMP_NUM_THREADS": "1"}  # fmt: skip


def warnings_in(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if WARNING.search(ln) and not any(e in ln for e in EXPLAINED_WARNINGS)]


COMMANDS = readme_commands()


EDIT_LOOP = ("make train", "python train.py --config configs/gpt3_175b.toml --print-config")
"""The commands `make test-fast` runs: a tiny training run on this CPU, and the 175B config read and
resolved; the others are marked slow (`make test` runs every one)."""


def readme_case(command: str):
    return pytest.param(command, id=run_key(command), marks=[] if run_key(command) in EDIT_LOOP else [pytest.mark.slow])


@pytest.mark.parametrize("command", [readme_case(c) for c in COMMANDS if RUNS.get(run_key(c)) is not None])
def test_readme_command_runs_without_warnings(tmp_path, request, command):
    where = workspace(tmp_path)
    before = NEEDS.get(run_key(command), [])
    if run_key(command) not in DEBUG_RUNS and any("checkpoints/debug" in c for c in [command, *before]):
        shutil.copytree(request.getfixturevalue("trained_debug"), where / "checkpoints/debug")
    for earlier in before:
        proc = run_readme_command(earlier, where)
        assert proc.returncode == 0, f"{earlier}\n{(proc.stdout + proc.stderr)[-6000:]}"
    proc = run_readme_command(command, where)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}\n{crash_stacks(output)}{output[-6000:]}"
    assert not warnings_in(output), f"{command} printed warnings:\n" + "\n".join(warnings_in(output))
    if run_key(command) in OUTPUTS:
        assert all((where / path).exists() for path in OUTPUTS[run_key(command)]), (command, sorted(where.rglob("*")))
    if command == MEGATRON_FLAGS:  # Megatron's flags set the keys; the internals one gets its note
        assert "> ignoring Megatron-LM flags that choose only Megatron's internals: --use-mcore-models" in proc.stdout
        assert "building a GPT of 2 layers, hidden 64, sequence 64" in proc.stdout
    if run_key(command) in (FROM_MEGATRON, FROM_TORCH, FROM_HF):
        run_the_printed_hint(proc.stdout, where, iteration=0 if command == FROM_HF else 4)
    if run_key(command) == TRAIN_ON_IT:  # its logs follow its checkpoint, not the debug config's run
        assert (where / "runs/corpus/metrics.jsonl").exists() and not (where / "runs/debug").exists()
    if command == GENERATE:
        assert proc.stdout.startswith("def ") and len(proc.stdout) > len("def "), proc.stdout  # the prompt, then the sample
        assert "> checkpoints/debug/iter_0000004: 40 tokens, temperature 0.8, top-k 20" in proc.stderr
    if run_key(command) in DEBUG_RUNS:
        # make train leaves a checkpoint and logs behind, and says how to sample from it
        assert (where / "checkpoints/debug/latest_checkpointed_iteration.txt").read_text().strip() == "4"
        assert (where / "runs/debug/metrics.jsonl").exists() and any((where / "runs/debug/tensorboard").iterdir())
        hint = proc.stdout.splitlines()[-1]
        assert "python scripts/generate.py checkpoints/debug" in hint
        # the hint runs as printed: its python is this venv's (`python` on the activated PATH, or a path)
        python = hint.split("sample from it with: ")[1].split()[0]
        assert os.path.abspath(shutil.which(python, path=activated_env()["PATH"])) == os.path.abspath(sys.executable)
        # the first line says at once what is being built
        assert proc.stdout.startswith("> dtgpt: configs/debug.toml on 1 rank(s): building a GPT of 4 layers"), proc.stdout[:300]
        # the start-up summary says what the run reads and where it writes
        assert "> data: built-in corpus 'python-docstrings', ByteTokenizer (257 ids)" in proc.stdout
        assert "> output: checkpoints checkpoints/debug (at the end); TensorBoard runs/debug/tensorboard" in proc.stdout


def run_the_printed_hint(stdout: str, where: Path, iteration: int) -> None:
    """A conversion's last line names the command that trains on from what it wrote: it runs as
    printed (shortened by two iterations past the converted one), from the converted iteration."""
    hint = stdout.strip().splitlines()[-1].split("train from it with: ")[1].split(" (it trains on mock data")[0]
    argv = shlex.split(hint) + [f"--training.train_iters={iteration + 2}", "--eval.eval_iters=0", "--logging.log_interval=1"]
    proc = subprocess.run(argv, cwd=where, env=activated_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{hint}\n{(proc.stdout + proc.stderr)[-4000:]}"
    assert f"iteration {iteration}, consumed samples" in proc.stdout and not warnings_in(proc.stdout + proc.stderr), proc.stdout


@pytest.mark.slow
def test_one_process_async_save_prints_no_warning(tmp_path):
    """DCP's background save thread warns that there is no process group, after the caller's
    `with` block has ended; a one-process run means exactly that (dtgpt/checkpoint/layout.py)."""
    where = workspace(tmp_path)
    argv = as_argv("python train.py --config configs/debug.toml") + SHORT_RUN + [
        "--checkpoint.async_save=true", "--checkpoint.save_interval=2",
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=where, env=activated_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "in the background" in proc.stdout and not warnings_in(proc.stdout + proc.stderr), proc.stdout + proc.stderr
