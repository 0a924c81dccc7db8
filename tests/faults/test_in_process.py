"""In-process recovery (dtgpt/faults/recovery.py): the decision, the twin groups, and the done-when
runs: 4 CPU ranks under `python -m dtgpt.run --max-restarts=2`, rank 3 SIGKILLed at iteration 15
on pp2 x dp_replicate 2 and tp2 x dp_replicate 2; on HSDP 2 x 2 a whole replica (ranks 2 and 3)
SIGKILLed together at iteration 10, then rank 1 at iteration 15, while the training script
holds a TCP connection of its own (tests/tcp_train.py). The ranks never killed keep their
processes, new ones join, every iteration is recorded once, losses and final weights equal an
uninterrupted run's bitwise (dropout on, so the RNG must come back too), and the script's
connection still works. A bug (a RuntimeError in one rank's forward) stops the job: nothing
redone, nothing restarted."""

from __future__ import annotations

import json
import os
import socket
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


def test_recovery_needs_a_rank_the_launcher_says_is_gone_and_happens_once_per_iteration():
    everyone = {**ALIVE, 3: Report(14, False)}
    assert verdict(True, 2, everyone, TWINS, replaced=set()) == "every rank answered the roll call, so no rank died"
    assert verdict(True, 2, ALIVE, TWINS, replaced={3}) is None
    stuck = verdict(True, 2, ALIVE, TWINS, replaced=set())
    assert stuck == "rank(s) [3] did not answer the roll call, yet the launcher did not say they died (stuck?)"
    replica = {0: Report(14, False), 1: Report(14, False)}
    assert verdict(True, 2, replica, TWINS, replaced={2, 3}) is None  # a whole replica lost, both twins alive
    redone_twice = verdict(True, 2, ALIVE, TWINS, replaced={3}, redone={"iteration 15"}, redo="iteration 15")
    assert redone_twice == "iteration 15 was redone once already"
    assert verdict(True, 2, ALIVE, TWINS, replaced={3}, redone={"iteration 15"}, redo="iteration 16") is None


def test_twin_groups_pair_the_ranks_that_differ_in_dp_replicate_only():
    def dims(pp, dpr, dps, tp):
        return SimpleNamespace(dp_replicate=dpr, mesh=SimpleNamespace(mesh=torch.arange(pp * dpr * dps * tp).reshape(pp, dpr, dps, 1, tp)))

    assert twin_groups(dims(1, 2, 2, 1)) == [[0, 2], [1, 3]]
    assert twin_groups(dims(2, 2, 1, 1)) == [[0, 1], [2, 3]]
    assert twin_groups(dims(1, 2, 1, 2)) == [[0, 2], [1, 3]]
    assert twin_groups(dims(2, 2, 2, 2)) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]


# -- the done-when runs ------------------------------------------------------------------------

ITERS, KILL_AT, REPLICA_KILL_AT = 20, 15, 10
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
KILLS = {  # layout -> (faults, {the iteration redone: the ranks replaced}); twins are [0, 2], [1, 3] on HSDP 2 x 2
    "hsdp-2x2": ([f"--faults.kill_at_iteration={REPLICA_KILL_AT}", "--faults.kill_rank=2", "--faults.kill_also_ranks=[3]",
                  f"--faults.kill_again_at_iteration={KILL_AT}", "--faults.kill_again_rank=1"],
                 {REPLICA_KILL_AT: [2, 3], KILL_AT: [1]}),  # fmt: skip
    "pp2-dpr2": ([f"--faults.kill_at_iteration={KILL_AT}", "--faults.kill_rank=3"], {KILL_AT: [3]}),
    "tp2-dpr2": ([f"--faults.kill_at_iteration={KILL_AT}", "--faults.kill_rank=3"], {KILL_AT: [3]}),
}
HOLDS_A_CONNECTION = "hsdp-2x2"


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


class ConnectionServer:
    """The far end of tests/tcp_train.py's connections: the lines each connection carried."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self.connections: list[list[str]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            lines: list[str] = []
            self.connections.append(lines)
            threading.Thread(target=self._serve, args=(connection, lines), daemon=True).start()

    @staticmethod
    def _serve(connection: socket.socket, lines: list[str]):
        with connection, connection.makefile() as reader:
            for line in reader:
                lines.append(line.strip())
                if line.startswith("bye"):
                    connection.sendall(b"ok\n")

    def close(self):
        self._listener.close()


def launch(
    where: Path, layout: list[str], extra: list[str], script: str = "train.py", env_extra: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, dict[int, set[int]]]:
    """`python -m dtgpt.run` on 4 CPU ranks; (its result, the worker PIDs seen per rank)."""
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dtgpt.run", "--standalone", "--nproc-per-node", "4", "--max-restarts=2",
           str(REPO / script), *train_argv(where, layout), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
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


def records(path: Path) -> list[tuple[int, float, float]]:
    """(iteration, loss, gradient norm) of each line of a metrics file."""
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines())]


def final_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = ckpt.parent / "final.pt"
    dcp_to_torch_save(ckpt / f"iter_{ITERS:07d}", target)
    return torch.load(target, weights_only=False)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sigkill_of_rank_3_is_recovered_in_process_bitwise(tmp_path, name, references):
    """(Named for the pp2 and tp2 cases; on HSDP: a whole replica, then a second death.)"""
    layout, (faults, replaced) = LAYOUTS[name], KILLS[name]
    reference, reference_dir = references[name]
    reference.checked()  # the uninterrupted run exited 0
    server = ConnectionServer() if name == HOLDS_A_CONNECTION else None
    script, env = ("tests/tcp_train.py", {"DTGPT_TEST_TCP": server.address}) if server else ("train.py", None)
    try:
        killed, pids = launch(tmp_path / "killed", layout, faults, script, env)
    finally:
        if server is not None:
            server.close()
    log = killed.stdout
    assert killed.returncode == 0, log[-6000:]
    for iteration, ranks in replaced.items():
        for rank in ranks:
            assert f"fault: SIGKILL to rank {rank} in iteration {iteration}" in log
        assert (f"in-process recovery: rank(s) {ranks} replaced, the others kept their state; iteration {iteration} "
                "is redone") in log, log[-6000:]  # fmt: skip
    assert log.count("is redone") == len(replaced)  # a co-kill is one recovery: its ranks die together (a store barrier)
    first = replaced[min(replaced)]
    assert log.count("1/2 restarts left") == len(first), log[-6000:]  # the first event drew one restart for them all
    assert "in-process recovery: rank 3 (replacement 1) took its state from rank" in log
    assert "loaded checkpoint" not in log and "last words" not in log
    dead = [rank for ranks in replaced.values() for rank in ranks]
    assert all(len(pids[r]) == 1 + dead.count(r) for r in range(4)), pids  # the others kept their processes
    got, want = records(tmp_path / "killed" / "metrics.jsonl"), records(reference_dir / "metrics.jsonl")
    assert [i for i, *_ in got] == list(range(1, ITERS + 1))  # every iteration recorded once
    assert got == want  # bitwise: float equality of every loss and gradient norm
    weights, reference_weights = final_weights(tmp_path / "killed" / "ckpt"), final_weights(reference_dir / "ckpt")
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)
    if server is not None:  # every process that lived to the end said bye on the connection it opened first
        said = {tuple(lines[0].split()[1:]): lines for lines in server.connections if lines}
        (rank_0,) = pids[0]
        assert said[("0", str(rank_0))] == [f"hello 0 {rank_0}", f"bye 0 {rank_0}"], server.connections
        finished = [lines for lines in said.values() if len(lines) == 2]
        assert len(finished) == 4 and all(b.split()[1:] == h.split()[1:] for h, b in finished), server.connections


@pytest.mark.slow
def test_a_bug_in_one_rank_stops_the_job_without_a_recovery_or_a_restart(tmp_path):
    """Rank 1's forward raises RuntimeError from iteration 3 on: no rank died, so nothing is
    redone or restarted; the job stops with the error's line, after last words."""
    # With a 30-minute collective timeout, a job that waited for one instead of stopping would
    # outlive launch()'s 900 s and fail here, however slowly a loaded machine runs the real stop.
    faults = ["--faults.raise_at_iteration=3", "--faults.raise_rank=1", "--distributed.timeout_minutes=30"]
    proc, pids = launch(tmp_path, LAYOUTS["hsdp-2x2"], faults)
    log = proc.stdout
    assert proc.returncode == 1, log[-6000:]
    bug = "rank 1 raised RuntimeError: injected bug in the model's forward (iteration 3)"
    assert f"stopping: {bug}; no rank died of it" in log, log[-6000:]
    assert f"python -m dtgpt.run: {bug}; the job is stopped, not restarted" in log
    assert "in-process recovery" not in log and "starting replacement" not in log and "restart worker group" not in log
    assert "last words: ranks [0, 1, 2, 3] saved iteration 2" in log
    assert all(len(pids[r]) == 1 for r in range(4)), pids  # nobody restarted or replaced
    tracebacks = [line for line in log.splitlines() if "Traceback" in line]
    assert tracebacks and all(line.startswith("[rank1]:") for line in tracebacks), log[-6000:]  # the bug's own, no echo
