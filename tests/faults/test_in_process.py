"""In-process recovery (dtgpt/faults/recovery.py): the decision, the twin groups, and the done-when
runs: 4 CPU ranks under `python -m dtgpt.run --max-restarts=2`, rank 3 SIGKILLed at iteration 15
on HSDP 2 x 2, pp2 x dp_replicate 2 and tp2 x dp_replicate 2. Ranks 0-2 keep their processes, a
new rank 3 joins, every iteration is recorded once, and losses and final weights equal an
uninterrupted run's bitwise (dropout on, so the RNG must come back too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dtgpt.faults.last_words import Report
from dtgpt.faults.recovery import twin_groups, verdict
from tests.runs import REPO, Command, Finished, launch_commands, selected_cases

TWINS = [[0, 2], [1, 3]]  # HSDP 2 x 2: rank r and r + 2 hold the same shards
ALIVE = {r: Report(14, False) for r in (0, 1, 2)}


def test_recovery_needs_the_launcher_a_replica_a_consistent_roll_and_a_surviving_twin():
    assert verdict(True, 2, ALIVE, TWINS) is None
    assert "not launched by `python -m dtgpt.run`" in verdict(False, 2, ALIVE, TWINS)
    assert "no replicas" in verdict(True, 1, ALIVE, [[0], [1], [2], [3]])
    assert verdict(True, 2, None, TWINS) == "this rank answered the roll call too late"
    stepping = {**ALIVE, 1: Report(14, True)}
    assert verdict(True, 2, stepping, TWINS) == "rank 1 was inside the optimizer step, so no iteration is intact"
    apart = {**ALIVE, 2: Report(15, False)}
    assert verdict(True, 2, apart, TWINS) == "the survivors completed different iterations [14, 15]"
    both_twins = {0: Report(14, False), 2: Report(14, False)}
    assert verdict(True, 2, both_twins, TWINS) == "rank(s) [1, 3] hold the same shards and all died"
    assert "roll_call_seconds=0" in verdict(True, 2, ALIVE, TWINS, roll_call_seconds=0)
    refused = verdict(True, 2, ALIVE, TWINS, {3: "restarts exhausted"})
    assert refused == "the launcher will not replace rank 3 (restarts exhausted)"


def test_twin_groups_pair_the_ranks_that_differ_in_dp_replicate_only():
    def dims(pp, dpr, dps, tp):
        return SimpleNamespace(dp_replicate=dpr, mesh=SimpleNamespace(mesh=torch.arange(pp * dpr * dps * tp).reshape(pp, dpr, dps, 1, tp)))

    assert twin_groups(dims(1, 2, 2, 1)) == [[0, 2], [1, 3]]
    assert twin_groups(dims(2, 2, 1, 1)) == [[0, 1], [2, 3]]
    assert twin_groups(dims(1, 2, 1, 2)) == [[0, 2], [1, 3]]
    assert twin_groups(dims(2, 2, 2, 2)) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]


# -- the done-when runs ------------------------------------------------------------------------

ITERS, KILL_AT = 20, 15
BASE = [
    "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
    "--model.make_vocab_size_divisible_by=64", "--model.hidden_dropout=0.1", "--model.attention_dropout=0.1",
    "--training.micro_batch_size=2", "--training.global_batch_size=8", f"--training.train_iters={ITERS}",
    "--optimizer.lr=3e-3", "--optimizer.lr_warmup_iters=2", "--optimizer.lr_decay_style=cosine",
    "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", "--data.vocab_size=128", "--data.num_workers=0",
    "--eval.eval_iters=0", "--logging.log_interval=1",
]  # fmt: skip
LAYOUTS = {
    "hsdp-2x2": ["--parallel.data_parallel_replicate_size=2", "--parallel.data_parallel_shard_size=2"],
    "pp2-dpr2": ["--parallel.pipeline_model_parallel_size=2", "--parallel.data_parallel_replicate_size=2",
                 "--parallel.data_parallel_shard_size=1"],  # fmt: skip
    "tp2-dpr2": ["--parallel.tensor_model_parallel_size=2", "--parallel.data_parallel_replicate_size=2",
                 "--parallel.data_parallel_shard_size=1"],  # fmt: skip
}


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _rank_of(pid: int) -> int | None:
    """The RANK of a training worker (train.py in its command line), else None."""
    try:
        if "train.py" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return None
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(item[5:]) for item in environ if item.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def launch(where: Path, layout: list[str], extra: list[str]) -> tuple[subprocess.CompletedProcess, dict[int, set[int]]]:
    """`python -m dtgpt.run` on 4 CPU ranks; (its result, the worker PIDs seen per rank)."""
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dtgpt.run", "--standalone", "--nproc-per-node", "4", "--max-restarts=2",
           str(REPO / "train.py"), *train_argv(where, layout), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: dict[int, set[int]] = {}
    done = threading.Event()

    def watch():
        while not done.wait(1.0):
            for pid in _descendants(proc.pid):
                rank = _rank_of(pid)
                if rank is not None:
                    pids.setdefault(rank, set()).add(pid)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        done.set()
        watcher.join()
    (where / "run.log").write_text(out)
    return subprocess.CompletedProcess(cmd, proc.returncode, out), pids


def train_argv(where: Path, layout: list[str]) -> list[str]:
    """train.py's arguments for a run of layout writing its metrics and checkpoints into where."""
    return [*BASE, *layout, f"--logging.metrics_file={where / 'metrics.jsonl'}", f"--checkpoint.save={where / 'ckpt'}"]


@pytest.fixture(scope="module")
def references(request, tmp_path_factory) -> dict[str, tuple[Finished, Path]]:
    """The selected layouts' uninterrupted runs, launched together: one 4-rank launch
    (tests/runs.py launch_commands) instead of one each. {layout: (its outcome, its directory)}."""
    names = selected_cases(request, test_sigkill_of_rank_3_is_recovered_in_process_bitwise)
    root = tmp_path_factory.mktemp("references")
    commands = []
    for name in names:
        where = root / name
        where.mkdir()
        commands.append(Command(name, where, train_argv(where, LAYOUTS[name]), 4, seconds=300))
    finished = launch_commands(commands) if commands else {}
    return {name: (finished[name], root / name) for name in names}


def records(path: Path) -> list[tuple[int, float]]:
    return [(r["iteration"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def final_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = ckpt.parent / "final.pt"
    dcp_to_torch_save(ckpt / f"iter_{ITERS:07d}", target)
    return torch.load(target, weights_only=False)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sigkill_of_rank_3_is_recovered_in_process_bitwise(tmp_path, name, references):
    layout = LAYOUTS[name]
    reference, reference_dir = references[name]
    reference.checked()  # the uninterrupted run exited 0
    killed, pids = launch(tmp_path / "killed", layout, [f"--faults.kill_at_iteration={KILL_AT}", "--faults.kill_rank=3"])
    log = killed.stdout
    assert killed.returncode == 0, log[-6000:]
    assert "fault: SIGKILL to rank 3 in iteration 15" in log
    assert "in-process recovery: rank(s) [3] replaced, the others kept their state; iteration 15 is redone" in log, log[-6000:]
    assert "in-process recovery: rank 3 (replacement 1) took its state from rank" in log
    assert "loaded checkpoint" not in log and "last words" not in log
    assert all(len(pids[r]) == 1 for r in (0, 1, 2)), pids  # the survivors kept their processes
    assert len(pids[3]) == 2, pids  # a new rank 3 joined
    got, want = records(tmp_path / "killed" / "metrics.jsonl"), records(reference_dir / "metrics.jsonl")
    assert [i for i, _ in got] == list(range(1, ITERS + 1))  # every iteration recorded once
    assert got == want  # bitwise: float equality of every loss
    weights, reference_weights = final_weights(tmp_path / "killed" / "ckpt"), final_weights(reference_dir / "ckpt")
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)
