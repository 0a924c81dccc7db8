"""Fault drill: break a small torchrun job in every way `[faults]` knows and check that it recovers.

    python scripts/fault_drill.py                      # every scenario, 3 random SIGKILL trials
    python scripts/fault_drill.py --trials 5 --seed 7 --nproc 2 --workdir /tmp/drill
    python scripts/fault_drill.py --only sigkill disk-full

Each scenario runs a tiny GPT (mock data, dropout on) for ITERS iterations on `--nproc` CPU
ranks under `torchrun --max-restarts=1`, checkpointing every SAVE_INTERVAL iterations with
`checkpoint.load == checkpoint.save` (automatic resume), and compares the per-iteration losses
(the last record of each iteration in the metrics file, which restarts append to) with an
uninterrupted run of the same config on the same mesh: they must be bitwise equal. It prints a
table: scenario, outcome, iterations lost (trained twice), checkpoint intact (the pointer names a
complete checkpoint and every checkpoint on disk is complete), losses equal after resume, and
exits 1 when a scenario did not recover. tests/faults/ runs a deterministic subset of these
scenario functions in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from dtgpt.checkpoint import layout  # noqa: E402

ITERS = 12
SAVE_INTERVAL = 3
BASE = [
    "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
    "--model.make_vocab_size_divisible_by=64", "--training.micro_batch_size=2", "--training.global_batch_size=8",
    "--optimizer.lr=3e-3", "--optimizer.lr_warmup_iters=2",
    "--optimizer.lr_decay_style=cosine", "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer",
    "--data.vocab_size=128", "--data.num_workers=0", "--eval.eval_iters=0", "--logging.log_interval=1",
    "--distributed.timeout_minutes=0.5",
]  # fmt: skip
ENV = {"OMP_NUM_THREADS": "1"}
OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Not set, even when the caller's environment has it: restarts must work on torchrun's shared
store as a plain torchrun command leaves it (dtgpt/attempt_store.py)."""
SHUTDOWN_TIMEOUT = 10
"""torchrun's grace period between forwarding a signal and SIGKILL (default 30 s)."""


OUR_CODE = (Path(layout.__file__).resolve().parents[1], REPO / "train.py")
"""The dtgpt package directory and the trainer script: a traceback frame in them is ours."""
FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+')


def our_traceback_frames(log: str) -> list[str]:
    """Traceback lines whose frame is dtgpt's own code, decided by the file's location, so a
    checkout or virtual environment under a folder named `dtgpt` does not count."""
    frames = []
    for line in log.splitlines():
        match = FRAME.match(line)
        if match:
            path = Path(match["path"]).resolve()
            if any(path == root or root in path.parents for root in OUR_CODE):
                frames.append(line)
    return frames


@dataclass
class Run:
    rc: int
    log: str
    seconds: float


@dataclass
class Result:
    scenario: str
    outcome: str
    lost: int | None = None
    intact: bool | None = None
    equal: bool | None = None
    ok: bool = False
    seconds: float = 0.0
    runs: list[Run] = field(default_factory=list)

    def row(self) -> str:
        def cell(v):
            return "n/a" if v is None else ("yes" if v is True else "NO" if v is False else str(v))

        cells = [self.scenario, self.outcome, cell(self.lost), cell(self.intact), cell(self.equal), f"{self.seconds:.0f}"]
        return "| " + " | ".join(cells) + " |"


def read_losses(path: Path) -> dict[int, float | None]:
    """The last record of each iteration (restarts append); a line cut by SIGKILL is skipped."""
    losses: dict[int, float | None] = {}
    if not path.exists():
        return losses
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        losses[record["iteration"]] = record["loss"]
    return losses


def trained_twice(path: Path) -> int:
    """Iterations with more than one record: the work a fault cost."""
    seen: dict[int, int] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            it = json.loads(line)["iteration"]
        except (json.JSONDecodeError, KeyError):
            continue
        seen[it] = seen.get(it, 0) + 1
    return sum(1 for n in seen.values() if n > 1)


def checkpoints_intact(root: Path) -> bool:
    """The pointer names a complete checkpoint and no iter_* directory is partial."""
    pointed = layout.read_pointer(root)
    if pointed is None or layout.problem(layout.iteration_dir(root, pointed)) is not None:
        return False
    return all(layout.problem(layout.iteration_dir(root, i)) is None for i in layout.list_iterations(root))


def plain_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != OPT_OUT}, **ENV}


class Drill:
    """Runs scenarios in `workdir/<scenario>/` on `nproc` ranks; caches the reference run."""

    def __init__(
        self, workdir: Path, nproc: int = 2, log=print, layout: list[str] = (), iters: int = ITERS, grace: int = SHUTDOWN_TIMEOUT,
    ):
        """`layout`: extra arguments of every run (a mesh, say); `iters`: training.train_iters;
        `grace`: torchrun's --shutdown-timeout."""
        self.workdir, self.nproc, self.log = Path(workdir), nproc, log
        self.layout, self.iters, self.grace = list(layout), iters, grace
        self._reference: dict[int, float] | None = None

    def command(self, restarts: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                f"--max-restarts={restarts}", f"--shutdown-timeout={self.grace}", str(REPO / "train.py")]  # fmt: skip

    def launch(self, where: Path, name: str, args: list[str], restarts: int = 1, on_line=None, timeout: float = 300) -> Run:
        """torchrun train.py BASE + args in `where`; `on_line(line, proc)` sees every output line."""
        where.mkdir(parents=True, exist_ok=True)
        cmd = self.command(restarts) + BASE + [f"--training.train_iters={self.iters}"] + self.layout + args
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=where, env=plain_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        # A job that outlives `timeout` (a hang nobody turned into an error) is killed, group and all.
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(line, proc)
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if time.monotonic() - start >= timeout:
            lines.append(f"fault drill: killed after {timeout} s\n")
        run = Run(proc.returncode, "".join(lines), time.monotonic() - start)
        (where / f"{name}.log").write_text(run.log)
        return run

    def place(self, name: str) -> tuple[str, Path]:
        """A fresh directory for scenario `name` (a repeated trial gets a suffix)."""
        unique, n = name, 1
        while (self.workdir / unique).exists():
            n += 1
            unique = f"{name}-{n}"
        return unique, self.workdir / unique

    def job(self, where: Path, extra: list[str]) -> list[str]:
        ckpt = where / "ckpt"
        return [f"--checkpoint.save={ckpt}", f"--checkpoint.load={ckpt}", f"--checkpoint.save_interval={SAVE_INTERVAL}",
                f"--logging.metrics_file={where / 'metrics.jsonl'}"] + extra  # fmt: skip

    def reference(self) -> dict[int, float]:
        """Losses of the uninterrupted run (once per Drill)."""
        if self._reference is None:
            where = self.workdir / "reference"
            run = self.launch(where, "run", self.job(where, []), restarts=0)
            if run.rc != 0:
                raise RuntimeError(f"the reference run failed ({run.rc}):\n{run.log[-3000:]}")
            self._reference = read_losses(where / "metrics.jsonl")
        return self._reference

    def finish(self, result: Result, where: Path, check_equal: bool = True) -> Result:
        """Fill lost / intact / equal from the scenario's directory; ok when all hold."""
        losses, reference = read_losses(where / "metrics.jsonl"), self.reference()
        result.lost = trained_twice(where / "metrics.jsonl")
        result.intact = checkpoints_intact(where / "ckpt") and layout.read_pointer(where / "ckpt") == self.iters
        if check_equal:
            result.equal = sorted(losses) == sorted(reference) and all(losses[i] == reference[i] for i in reference)
        result.seconds = sum(r.seconds for r in result.runs)
        result.ok = result.intact and result.equal is not False and all(r.rc == 0 for r in result.runs[-1:])
        return result

    # -- scenarios -------------------------------------------------------------------------------

    def sigkill(self, rank: int, iteration: int, during_save: bool = False, async_save: bool = False) -> Result:
        """SIGKILL of one rank mid-iteration (or while it writes a checkpoint); torchrun restarts
        the group, which resumes from the newest complete checkpoint."""
        name = f"sigkill-{'save-' + ('async' if async_save else 'sync') if during_save else 'iteration'}-r{rank}-i{iteration}"
        name, where = self.place(name)
        faults = [f"--faults.kill_at_iteration={iteration}", f"--faults.kill_rank={rank}",
                  f"--faults.kill_during_save={during_save}", f"--checkpoint.async_save={async_save}"]  # fmt: skip
        run = self.launch(where, "run", self.job(where, faults))
        resumed = re.search(r"loaded checkpoint \S+ in [\d.]+ s: iteration (\d+)", run.log)
        if run.rc != 0:
            outcome = f"FAILED (rc {run.rc})"
        elif resumed:
            outcome = f"restarted, resumed from {resumed.group(1)}"
        elif run.log.count("starting from scratch") == 2:  # killed before the first checkpoint
            outcome = "restarted, from scratch (no checkpoint yet)"
        else:
            outcome = "FAILED: the restart did not resume"
        if "fault: SIGKILL" not in run.log:
            outcome = "FAILED: the fault did not fire"
        result = self.finish(Result(name, outcome, runs=[run]), where)
        result.ok = result.ok and outcome.startswith("restarted")
        return result

    def stop_signal(self, sig: str = "SIGTERM", whole_group: bool = False, after: int = 4) -> Result:
        """A signal to torchrun (Slurm preemption), or to its whole process group (Ctrl-C), after
        iteration `after` is logged: every rank finishes its iteration, saves, and exits; a
        second launch resumes from that checkpoint."""
        name = f"{sig.lower()}-{'group' if whole_group else 'torchrun'}"
        name, where = self.place(name)
        sent = []

        def on_line(line, proc):
            if not sent and re.match(rf"\s*\[[^]]*\] iteration\s+{after}/", line):
                (os.killpg if whole_group else os.kill)(proc.pid, getattr(signal, sig))
                sent.append(time.monotonic())

        first = self.launch(where, "stopped", self.job(where, []), restarts=0, on_line=on_line)
        stopped = layout.read_pointer(where / "ckpt")
        agreed = first.log.count("> training stopped: exit signal received") == 1
        second = self.launch(where, "resumed", self.job(where, []), restarts=0)
        outcome = f"stopped and saved at {stopped}, resumed" if agreed and stopped and stopped < self.iters else "FAILED"
        result = self.finish(Result(name, outcome, runs=[first, second]), where)
        result.ok = result.ok and agreed and bool(sent)
        return result

    def signal_one_rank(self, rank: int, iteration: int = 5, sig: str = "SIGTERM") -> Result:
        """faults.signal_at_iteration: one rank gets `sig` mid-iteration (and SIGTERM + SIGINT
        again while the checkpoint is written). All ranks stop together and exit 0, so torchrun
        exits 0 too; a second launch resumes."""
        name = f"{sig.lower()}-one-rank-r{rank}-i{iteration}"
        name, where = self.place(name)
        faults = [f"--faults.signal_at_iteration={iteration}", f"--faults.signal_rank={rank}", f"--faults.signal_name={sig}"]
        first = self.launch(where, "stopped", self.job(where, faults), restarts=0)
        stopped = layout.read_pointer(where / "ckpt")
        second = self.launch(where, "resumed", self.job(where, []), restarts=0)
        ok = first.rc == 0 and stopped == iteration and "again: ignored" in first.log
        outcome = f"all ranks saved {stopped} and exited 0, resumed" if ok else f"FAILED (rc {first.rc}, saved {stopped})"
        result = self.finish(Result(name, outcome, runs=[first, second]), where)
        result.ok = result.ok and ok
        return result

    def hang(self, rank: int, iteration: int) -> Result:
        """One rank sleeps forever: the others' collective times out after
        distributed.timeout_minutes with an error naming rank, phase and iteration, heartbeat
        lines appear before that, and torchrun's restart resumes."""
        name = f"hang-r{rank}-i{iteration}"
        name, where = self.place(name)
        faults = [f"--faults.hang_at_iteration={iteration}", f"--faults.hang_rank={rank}", "--distributed.timeout_minutes=0.1",
                  "--distributed.heartbeat_factor=2", "--distributed.heartbeat_min_seconds=1"]  # fmt: skip
        run = self.launch(where, "run", self.job(where, faults))
        named = re.search(rf"rank \d+: train-step of iteration {iteration} failed", run.log) is not None
        beat = f"in 'train-step' of iteration {iteration}" in run.log
        outcome = "timed out naming rank/phase/iteration, heartbeat, restarted" if named and beat and run.rc == 0 else "FAILED"
        result = self.finish(Result(name, outcome, runs=[run]), where)
        result.ok = result.ok and named and beat
        return result

    def nan_batch(self, iteration: int = 5) -> Result:
        """A non-finite loss: the iteration is skipped and counted, training goes on."""
        name = f"nan-batch-i{iteration}"
        name, where = self.place(name)
        run = self.launch(where, "run", self.job(where, [f"--faults.nan_at_iterations=[{iteration}]"]), restarts=0)
        losses, reference = read_losses(where / "metrics.jsonl"), self.reference()
        skipped = losses.get(iteration) is None and f"iteration {iteration}: non-finite loss" in run.log
        result = self.finish(Result(name, "skipped 1 iteration, finished" if skipped else "FAILED", runs=[run]),
                             where, check_equal=False)  # fmt: skip
        # The skipped step changes what follows; before it, the run is the reference.
        same_before = all(losses[i] == reference[i] for i in range(1, iteration))
        result.ok = result.ok and skipped and same_before
        return result

    def disk_full(self, rank: int, iteration: int = 6) -> Result:
        """ENOSPC while writing a checkpoint: a clear error, the previous checkpoint and the pointer
        survive; the relaunched job resumes from them."""
        name = f"disk-full-r{rank}-i{iteration}"
        name, where = self.place(name)
        first = self.launch(where, "failed", self.job(where, [f"--faults.disk_full_at_iteration={iteration}",
                                                               f"--faults.disk_full_rank={rank}"]), restarts=0)  # fmt: skip
        previous = iteration - SAVE_INTERVAL
        ckpt = where / "ckpt"
        survived = layout.read_pointer(ckpt) == previous and not layout.problem(layout.iteration_dir(ckpt, previous))
        clear = re.search(r"error: .*No space left on device.*latest_checkpointed_iteration.txt not moved", first.log)
        second = self.launch(where, "resumed", self.job(where, []), restarts=0)
        ok = "(exitcode: 2)" in first.log and survived and clear is not None  # train.py's 2; torchrun exits 1
        outcome = f"clear error, pointer kept at {previous}, resumed" if ok else f"FAILED (rc {first.rc})"
        result = self.finish(Result(name, outcome, runs=[first, second]), where)
        result.ok = result.ok and ok
        return result

    def deleted_shard(self, stop_at: int = 6) -> Result:
        """A data file (`__0_0.distcp`) of the newest checkpoint is deleted: the resumed job warns,
        falls back to the previous complete checkpoint and finishes."""
        name = "deleted-shard"
        name, where = self.place(name)
        first = self.launch(where, "first", self.job(where, [f"--checkpoint.exit_interval={stop_at}"]), restarts=0)
        (layout.iteration_dir(where / "ckpt", stop_at) / "__0_0.distcp").unlink()
        second = self.launch(where, "resumed", self.job(where, []), restarts=0)
        fell_back = "file __0_0.distcp is missing" in second.log and re.search(
            rf"loaded checkpoint \S+ in [\d.]+ s: iteration {stop_at - SAVE_INTERVAL}\b", second.log)  # fmt: skip
        outcome = f"fell back to {stop_at - SAVE_INTERVAL}, finished" if fell_back else "FAILED"
        result = self.finish(Result(name, outcome, runs=[first, second]), where)
        result.ok = result.ok and bool(fell_back)
        return result

    def corrupt_idx(self) -> Result:
        """A corrupted `.idx`: refused at start-up with one `error:` line naming the file."""
        import numpy as np

        from dtgpt.data.indexed import IndexedDatasetWriter

        name = "corrupt-idx"
        name, where = self.place(name)
        where.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        with IndexedDatasetWriter(where / "corpus") as writer:
            for _ in range(100):
                writer.add_document(rng.integers(0, 127, 40))
        with open(where / "corpus.idx", "r+b") as f:  # the sequence count in the header
            f.seek(18)
            f.write((12345).to_bytes(8, "little"))
        run = self.launch(where, "run", self.job(where, ["--data.mock_data=false", f"--data.data_path={where / 'corpus'}"]),
                          restarts=0)  # fmt: skip
        errors = [ln for ln in run.log.splitlines() if ln.startswith("error: ")]
        ours = our_traceback_frames(run.log)
        ok = run.rc != 0 and errors and "corpus.idx" in errors[0] and not ours
        outcome = f"refused: {errors[0][7:].replace(str(where) + '/', '')[:60]}..." if ok else "FAILED"
        return Result(name, outcome, ok=bool(ok), seconds=run.seconds, runs=[run])


def scenarios(drill: Drill, trials: int, seed: int) -> list[tuple[str, object]]:
    """(name, run) of every scenario; the SIGKILLs hit random ranks and iterations (seeded)."""
    rng = random.Random(seed)
    n, save = drill.nproc, 2 * SAVE_INTERVAL
    trials = rng.sample([(r, i) for r in range(n) for i in range(2, ITERS)], min(trials, n * (ITERS - 2)))
    todo = [("sigkill-iteration", lambda r=r, i=i: drill.sigkill(r, i)) for r, i in trials]
    return todo + [
        ("sigterm-torchrun", lambda: drill.stop_signal("SIGTERM")),
        ("sigint-group", lambda: drill.stop_signal("SIGINT", whole_group=True)),
        ("sigterm-one-rank", lambda r=rng.randrange(n): drill.signal_one_rank(r)),
        ("sigkill-save-sync", lambda r=rng.randrange(n): drill.sigkill(r, save, during_save=True)),
        ("sigkill-save-async", lambda r=rng.randrange(n): drill.sigkill(r, save, during_save=True, async_save=True)),
        ("hang", lambda r=rng.randrange(n): drill.hang(r, 5)),
        ("nan-batch", drill.nan_batch),
        ("disk-full", lambda r=rng.randrange(n): drill.disk_full(r)),
        ("corrupt-idx", drill.corrupt_idx),
        ("deleted-shard", drill.deleted_shard),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/dtgpt_fault_drill")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3, help="random SIGKILL trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="run scenarios whose name starts with one of these")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    if workdir.exists():
        import shutil

        shutil.rmtree(workdir)
    drill = Drill(workdir, args.nproc)
    header = ["| scenario | outcome | iterations lost | checkpoint intact | losses equal after resume | seconds |",
              "|---|---|---:|---|---|---:|"]  # fmt: skip
    print(f"fault drill: {args.nproc} ranks, {ITERS} iterations, checkpoint every {SAVE_INTERVAL}, work in {workdir}",
          flush=True)  # fmt: skip
    drill.reference()
    rows = []
    for name, scenario in scenarios(drill, args.trials, args.seed):
        if args.only and not any(name.startswith(p) for p in args.only):
            continue
        result = scenario()
        rows.append(result)
        print(result.row(), flush=True)
    print("\n".join(header + [r.row() for r in rows]))
    failed = [r.scenario for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} scenarios recovered" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
