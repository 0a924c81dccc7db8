"""The fault drill's plumbing: launch train.py under torchrun, read back what a scenario left.

`scripts/drill_scenarios.py` holds the scenarios, `scripts/fault_drill.py` runs them and prints
the table; this module holds the run itself (one torchrun job, killed if it outlives its
timeout), the reference run, and the measures of a scenario: losses (the last record of each
iteration), iterations trained twice, checkpoints complete or lost, tracebacks printed.
"""


from __future__ import annotations

import json
import os
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
]  # fmt: skip
"""The default collective timeout (10 minutes): a dead rank is detected without it (dtgpt/faults/detect.py)."""
ENV = {"OMP_NUM_THREADS": "1"}
OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Not set, even when the caller's environment has it: restarts must work on torchrun's shared
store as a plain torchrun command leaves it (dtgpt/faults/attempt_store.py)."""
SHUTDOWN_TIMEOUT = 10
"""torchrun's grace period between forwarding a signal and SIGKILL (default 30 s) on 2 ranks,
where no rank has last words to say; None leaves torchrun's default."""
STOP_GRACE = 120
"""The grace period of a job the drill stops with a signal: the workers finish their iteration and
save in it, which a loaded machine stretches past SHUTDOWN_TIMEOUT; they exit as soon as they have
saved, so it costs nothing."""


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


def traceback_ranks(log: str) -> list[int]:
    """The ranks that printed a traceback: torch prefixes a rank's uncaught error with `[rankN]:`
    (-1: a traceback without it). A survivor leaving after a fault prints none (docs/faults.md)."""
    ranks = set()
    for line in log.splitlines():
        if "Traceback (most recent call last)" in line:
            prefix = re.match(r"\[rank(\d+)\]:", line)
            ranks.add(int(prefix[1]) if prefix else -1)
    return sorted(ranks)


@dataclass
class Run:
    rc: int
    log: str
    seconds: float
    lines_at: list[tuple[float, str]] = field(default_factory=list)
    """Each output line with the seconds since the launch at which the drill read it."""
    worker_pids: dict[int, set[int]] = field(default_factory=dict)
    """RANK -> the pids of the launcher's children that had it (sampled while the job ran)."""


ITERATION_LINE = re.compile(r"^\s*\[[^]]*\] iteration\s+(\d+)/")


def recovery_seconds(run: Run, completed_before: int) -> float | None:
    """From the `fault: SIGKILL` line to the first logged iteration beyond those completed when the
    rank died (`completed_before`, or a later one logged before the kill line: an async save's
    thread kills while the next iteration runs): how long the job took to make progress again."""
    # the dying rank's line may share a line with another rank's output, so it is looked for anywhere
    killed = next((t for t, line in run.lines_at if "fault: SIGKILL" in line), None)
    if killed is None:
        return None
    logged = [int(m[1]) for t, line in run.lines_at if t < killed and (m := ITERATION_LINE.match(line))]
    completed_before = max([completed_before, *logged])
    for t, line in run.lines_at:
        match = ITERATION_LINE.match(line)
        if t >= killed and match and int(match[1]) > completed_before:
            return t - killed
    return None


class WorkerWatch:
    """Samples the children of a launcher (its workers) and their RANK, from /proc, until stopped."""

    def __init__(self, launcher_pid: int, period: float = 0.2):
        self.pid, self.period, self.seen = launcher_pid, period, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) not in self.seen:
                    self._look(int(entry))

    def _look(self, pid: int) -> None:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent != self.pid:
                return
            env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        except (OSError, IndexError, ValueError):
            return
        if "RANK" in env:
            self.seen[pid] = int(env["RANK"])

    def stop(self) -> dict[int, set[int]]:
        self._stop.set()
        self._thread.join()
        by_rank: dict[int, set[int]] = {}
        for pid, rank in self.seen.items():
            by_rank.setdefault(rank, set()).add(pid)
        return by_rank


HEADER = [
    "| scenario | outcome | recovered | iterations recomputed | checkpoints lost | losses equal after resume | seconds |",
    "|---|---|---|---:|---:|---|---:|",
]


@dataclass
class Result:
    scenario: str
    outcome: str
    lost: int | None = None
    """Iterations trained twice: recomputed after the restart."""
    checkpoints_lost: int | None = None
    intact: bool | None = None
    equal: bool | None = None
    ok: bool = False
    """Recovered: finished with every check passing."""
    seconds: float = 0.0
    runs: list[Run] = field(default_factory=list)
    pids_kept: bool | None = None
    """In-process scenarios: the dead rank had two processes, every other rank one."""
    recovery: float | None = None
    """Seconds from the kill to the first iteration beyond those completed before it."""

    def row(self) -> str:
        def cell(v):
            return "n/a" if v is None else ("yes" if v is True else "NO" if v is False else str(v))

        cells = [self.scenario, self.outcome, cell(self.ok), cell(self.lost), cell(self.checkpoints_lost), cell(self.equal),
                 f"{self.seconds:.0f}"]  # fmt: skip
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


def checkpoints_lost(root: Path, iters: int) -> int:
    """Periodic checkpoints (every SAVE_INTERVAL up to `iters`) not complete at the end."""
    due = range(SAVE_INTERVAL, iters + 1, SAVE_INTERVAL)
    return sum(1 for i in due if layout.problem(layout.iteration_dir(root, i)) is not None)


def checkpoints_intact(root: Path) -> bool:
    """The pointer names a complete checkpoint and no iter_* directory is partial."""
    pointed = layout.read_pointer(root)
    if pointed is None or layout.problem(layout.iteration_dir(root, pointed)) is not None:
        return False
    return all(layout.problem(layout.iteration_dir(root, i)) is None for i in layout.list_iterations(root))


def plain_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != OPT_OUT}, **ENV}


def torchrun_takes_shutdown_timeout() -> bool:
    """torchrun's --shutdown-timeout came after torch 2.11 (whose grace period is a fixed 30 s):
    given only where this torch's torchrun parses it."""
    from torch.distributed.run import get_args_parser

    _args, unknown = get_args_parser().parse_known_args(["--shutdown-timeout=1", "train.py"])
    return not unknown


class Runner:
    """Runs jobs in `workdir/<scenario>/` on `nproc` ranks; caches the reference run."""

    def __init__(
        self, workdir: Path, nproc: int = 2, log=print, layout: list[str] = (), iters: int = ITERS,
        grace: int | None = SHUTDOWN_TIMEOUT, label: str = "", launcher: str = "torch.distributed.run",
    ):
        """`layout`: extra arguments of every run (a mesh, say); `iters`: training.train_iters;
        `grace`: torchrun's --shutdown-timeout (None: its default); `label`: a prefix of scenario names;
        `launcher`: the module that launches (torchrun's, or dtgpt.run, which replaces a dead worker alone)."""
        self.workdir, self.nproc, self.log = Path(workdir), nproc, log
        self.layout, self.iters, self.grace, self.label = list(layout), iters, grace, label
        self.launcher = launcher
        self._reference: dict[int, float] | None = None

    def command(self, restarts: int, grace: int | None) -> list[str]:
        grace = [] if grace is None or not torchrun_takes_shutdown_timeout() else [f"--shutdown-timeout={grace}"]
        return [sys.executable, "-m", self.launcher, "--standalone", f"--nproc-per-node={self.nproc}",
                f"--max-restarts={restarts}", *grace, str(REPO / "train.py")]  # fmt: skip

    def launch(
        self, where: Path, name: str, args: list[str], restarts: int = 1, on_line=None, timeout: float = 300, stopped: bool = False
    ) -> Run:
        """torchrun train.py BASE + args in `where`; `on_line(line, proc)` sees every output line.
        `stopped`: the drill stops it with a signal (torchrun's grace is then STOP_GRACE)."""
        where.mkdir(parents=True, exist_ok=True)
        cmd = self.command(restarts, STOP_GRACE if stopped else self.grace) + BASE + [f"--training.train_iters={self.iters}"] + self.layout + args
        start = time.monotonic()
        env = plain_env()
        if self.launcher != "torch.distributed.run":  # a launcher module of this checkout, run from `where`
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        watch = WorkerWatch(proc.pid)
        # A job that outlives `timeout` (a hang nobody turned into an error) is killed, group and all.
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        lines_at = []
        try:
            for line in proc.stdout:
                lines_at.append((time.monotonic() - start, line))
                if on_line is not None:
                    on_line(line, proc)
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if time.monotonic() - start >= timeout:
            lines_at.append((time.monotonic() - start, f"fault drill: killed after {timeout} s\n"))
        run = Run(proc.returncode, "".join(line for _t, line in lines_at), time.monotonic() - start, lines_at, watch.stop())
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
        """Fill lost / checkpoints_lost / intact / equal from the scenario's directory; ok when all hold."""
        losses, reference = read_losses(where / "metrics.jsonl"), self.reference()
        result.lost = trained_twice(where / "metrics.jsonl")
        result.checkpoints_lost = checkpoints_lost(where / "ckpt", self.iters)
        result.intact = checkpoints_intact(where / "ckpt") and layout.read_pointer(where / "ckpt") == self.iters
        if check_equal:
            result.equal = sorted(losses) == sorted(reference) and all(losses[i] == reference[i] for i in reference)
        result.seconds = sum(r.seconds for r in result.runs)
        result.ok = result.intact and result.equal is not False and all(r.rc == 0 for r in result.runs[-1:])
        return result
