"""The fault drill's scenarios: each method of `Drill` breaks a small job one way and checks what
it left; `scenarios`, `last_words_scenarios` and `in_process_scenarios` list which ranks and
iterations each run hits (seeded). `scripts/fault_drill.py` runs them and prints the table; the
plumbing (one job, the reference run, the measures) is `scripts/drill_runs.py`, the kinds of
SIGKILL `scripts/drill_kills.py`.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # drill_runs, also when loaded by path
from drill_kills import FALLS_BACK, completed_at_kill, kill_faults, kill_kind  # noqa: E402
from drill_runs import (  # noqa: E402
    ITERS, SAVE_INTERVAL, Result, Runner, layout, our_traceback_frames, read_losses, recovery_seconds, traceback_ranks,
)

HSDP = ["--parallel.data_parallel_replicate_size=2", "--parallel.data_parallel_shard_size=2"]
NO_REPLICAS = ["--parallel.data_parallel_replicate_size=1", "--parallel.data_parallel_shard_size=4"]
REPLICATED = {
    "hsdp": HSDP,
    "pp2-dpr2": ["--parallel.pipeline_model_parallel_size=2", "--parallel.data_parallel_replicate_size=2",
                 "--parallel.data_parallel_shard_size=1"],  # fmt: skip
    "tp2-dpr2": ["--parallel.tensor_model_parallel_size=2", "--parallel.data_parallel_replicate_size=2",
                 "--parallel.data_parallel_shard_size=1"],  # fmt: skip
}
"""The 4-rank layouts with a replica of every shard, where a dead rank can be replaced in-process."""
HANG_LIMITS = ["--distributed.timeout_minutes=0.25", "--distributed.heartbeat_factor=0.01", "--distributed.heartbeat_min_seconds=1"]
"""A hang's peers time out after 15 s, and a heartbeat is due after 1 s whatever the median iteration
(factor 0.01): on a loaded machine a 6 s timeout also caught a healthy peer still starting up, and
a heartbeat due at twice a slow median came after the timeout."""


class Drill(Runner):
    """The scenarios, each on a fresh directory."""

    # -- scenarios -------------------------------------------------------------------------------

    def sigkill(self, rank: int, iteration: int, during: str = "iteration", async_save: bool = False) -> Result:
        """SIGKILL of one rank at the start of `iteration` (its peers fail in forward/backward),
        inside its optimizer step (`during="step"`) or while it writes that iteration's checkpoint
        (`during="save"`). Survivors holding a whole replica save the last completed iteration
        (last words); torchrun restarts the group, which resumes from the newest checkpoint. No
        survivor prints a traceback."""
        name, where = self.place(f"{self.label}sigkill-{kill_kind(during, async_save)}-r{rank}-i{iteration}")
        run = self.launch(where, "run", self.job(where, kill_faults(rank, iteration, during, async_save)))
        resumed = re.search(r"loaded checkpoint \S+ in [\d.]+ s: iteration (\d+)", run.log)
        spoke = re.search(r"last words: ranks \S.*? saved iteration (\d+)", run.log)
        silent = re.search(r"last words: none \((.*?)\);", run.log)
        if run.rc != 0:
            outcome = f"FAILED (rc {run.rc})"
        elif resumed:
            outcome = f"restarted, resumed from {resumed.group(1)}"
        elif run.log.count("starting from scratch") == 2:  # killed before the first checkpoint
            outcome = "restarted, from scratch (no checkpoint yet)"
        else:
            outcome = "FAILED: the restart did not resume"
        if spoke:
            outcome = f"last words saved {spoke.group(1)}; {outcome}"
        elif silent:
            outcome = f"no last words ({silent.group(1).split(', so')[0]}); {outcome}"
        if "fault: SIGKILL" not in run.log:
            outcome = "FAILED: the fault did not fire"
        shown = traceback_ranks(run.log)
        if shown:
            outcome = f"{outcome}; FAILED: a traceback from rank(s) {shown}"
        result = self.finish(Result(name, outcome, runs=[run]), where)
        result.ok = result.ok and "restarted" in outcome and "FAILED" not in outcome
        result.recovery = recovery_seconds(run, completed_at_kill(iteration, during))
        return result

    def replace(
        self, rank: int, iteration: int, during: str = "iteration", async_save: bool = False, also: tuple[int, ...] = ()
    ) -> Result:
        """The same kill under `python -m dtgpt.run --max-restarts=2` (a Drill with launcher="dtgpt.run"):
        only the dead rank is started again, the survivors keep their processes and their state
        (in-process recovery), and the interrupted iteration is redone; nothing is trained twice.
        `also`: ranks killed with `rank`, at the same point (a whole replica), replaced together."""
        dead = {rank, *also}
        ranks = "".join(f"-r{r}" for r in sorted(dead))
        name, where = self.place(f"{self.label}replace-{kill_kind(during, async_save)}{ranks}-i{iteration}")
        faults = kill_faults(rank, iteration, during, async_save) + ([f"--faults.kill_also_ranks={list(also)}"] if also else [])
        run = self.launch(where, "run", self.job(where, faults), restarts=2)
        replaced = re.search(r"in-process recovery: rank\(s\) (\[[\d, ]+\]) replaced, the others kept their state; (.*?) is redone", run.log)
        # a replaced rank 0 logs its own line instead (the survivors' line is rank 0's)
        joined = re.search(r"in-process recovery: rank (\d+) \(replacement \d+\) took its state from rank (\d+) at iteration (\d+)", run.log)
        refused = re.search(r"in-process recovery: none \((.*?)\);", run.log)
        spoke = re.search(r"last words: ranks \S.*? saved iteration (\d+)", run.log)
        resumed = re.search(r"loaded checkpoint \S+ in [\d.]+ s: iteration (\d+)", run.log)
        fell_back = bool(refused and during in FALLS_BACK and FALLS_BACK[during] in refused[1] and spoke and resumed)
        if "fault: SIGKILL" not in run.log:
            outcome = "FAILED: the fault did not fire"
        elif run.rc != 0:
            outcome = f"FAILED (rc {run.rc})"
        elif replaced:
            outcome = f"rank(s) {replaced[1]} replaced in-process, {replaced[2]} redone"
        elif joined:
            outcome = f"rank {joined[1]} replaced in-process, its state from rank {joined[2]} at iteration {joined[3]}"
        elif fell_back:
            outcome = f"fell back ({refused[1]}): last words saved {spoke[1]}, restarted, resumed from {resumed[1]}"
        else:
            outcome = f"not in-process ({refused[1] if refused else 'no recovery line'})"
        shown = traceback_ranks(run.log)
        if shown:
            outcome = f"{outcome}; FAILED: a traceback from rank(s) {shown}"
        result = self.finish(Result(name, outcome, runs=[run]), where)
        pids = run.worker_pids
        result.pids_kept = sorted(pids) == list(range(self.nproc)) and all(
            len(p) == (2 if r in dead else 1) for r, p in pids.items())  # fmt: skip
        result.recovery = recovery_seconds(run, completed_at_kill(iteration, during))
        if fell_back:  # the full restart it announced: recovered, nothing recomputed, new processes
            result.ok = result.ok and result.lost == 0 and not shown
        else:
            result.ok = result.ok and bool(replaced or joined) and result.pids_kept and result.lost == 0 and not shown
        return result

    def bug(self, rank: int, iteration: int) -> Result:
        """Under dtgpt.run, `rank`'s forward raises RuntimeError from `iteration` on: a bug, not a
        death. The job stops with the error's line after last words (exit 1); nothing is redone,
        restarted or replaced, and only `rank` prints a traceback (its bug's)."""
        name, where = self.place(f"{self.label}bug-r{rank}-i{iteration}")
        faults = [f"--faults.raise_at_iteration={iteration}", f"--faults.raise_rank={rank}"]
        run = self.launch(where, "run", self.job(where, faults), restarts=2)
        stopped = re.search(r"stopping: (rank \d+ raised \w+)", run.log)
        spoke = re.search(r"last words: ranks \S.*? saved iteration (\d+)", run.log)
        quiet = not any(s in run.log for s in ("is redone", "starting replacement", "restart worker group"))
        pids = run.worker_pids
        kept = sorted(pids) == list(range(self.nproc)) and all(len(p) == 1 for p in pids.values())
        shown = traceback_ranks(run.log)  # the raising rank's own, no other's
        ok = run.rc == 1 and bool(stopped) and quiet and kept and shown == [rank]
        outcome = (f"stopped: {stopped[1]}, last words saved {spoke[1] if spoke else 'nothing'}, nothing redone or restarted"
                   if ok else f"FAILED (rc {run.rc}, {'a stop line' if stopped else 'no stop line'}, "
                              f"{'quiet' if quiet else 'redone or restarted'}, tracebacks from rank(s) {shown})")  # fmt: skip
        return Result(name, outcome, lost=0, ok=ok, seconds=run.seconds, runs=[run], pids_kept=kept)

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

        first = self.launch(where, "stopped", self.job(where, []), restarts=0, on_line=on_line, stopped=True)
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
        faults = [f"--faults.hang_at_iteration={iteration}", f"--faults.hang_rank={rank}", *HANG_LIMITS]
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
    """(name, run) of every scenario of `drill`; the SIGKILLs hit random ranks and iterations (seeded)."""
    rng = random.Random(seed)
    n, save = drill.nproc, 2 * SAVE_INTERVAL
    trials = rng.sample([(r, i) for r in range(n) for i in range(2, ITERS)], min(trials, n * (ITERS - 2)))
    todo = [("sigkill-iteration", lambda r=r, i=i: drill.sigkill(r, i)) for r, i in trials]
    return todo + [
        ("sigterm-torchrun", lambda: drill.stop_signal("SIGTERM")),
        ("sigint-group", lambda: drill.stop_signal("SIGINT", whole_group=True)),
        ("sigterm-one-rank", lambda r=rng.randrange(n): drill.signal_one_rank(r)),
        ("sigkill-save-sync", lambda r=rng.randrange(n): drill.sigkill(r, save, during="save")),
        ("sigkill-save-async", lambda r=rng.randrange(n): drill.sigkill(r, save, during="save", async_save=True)),
        ("hang", lambda r=rng.randrange(n): drill.hang(r, 5)),
        ("nan-batch", drill.nan_batch),
        ("disk-full", lambda r=rng.randrange(n): drill.disk_full(r)),
        ("corrupt-idx", drill.corrupt_idx),
        ("deleted-shard", drill.deleted_shard),
    ]


def last_words_scenarios(hsdp: Drill, no_replicas: Drill, seed: int) -> list[tuple[str, object]]:
    """SIGKILLs of a random rank at a random iteration on 4 ranks: on HSDP (dp_replicate 2 x
    dp_shard 2) in forward/backward, in the optimizer step and in an async save, where the
    survivors hold a whole replica; and in forward/backward without replicas (dp_shard 4)."""
    rng = random.Random(seed)

    def pick(ranks: int) -> tuple[int, int]:
        return rng.randrange(ranks), rng.choice([i for i in range(2, ITERS) if i % SAVE_INTERVAL])

    # The last rank writes the metrics file: killed after its peers finished an iteration (in
    # the optimizer step, or by its own async save's thread), that iteration is trained and
    # saved but has no record, and the loss comparison could not tell. So those hit the others.
    n = hsdp.nproc
    (r1, i1), (r2, i2), (r3, _), (r4, i4) = pick(n), pick(n - 1), pick(n - 1), pick(n)
    return [
        ("hsdp-sigkill-iteration", lambda: hsdp.sigkill(r1, i1)),
        ("hsdp-sigkill-step", lambda: hsdp.sigkill(r2, i2, during="step")),
        ("hsdp-sigkill-save-async", lambda: hsdp.sigkill(r3, 2 * SAVE_INTERVAL, during="save", async_save=True)),
        ("no-replicas-sigkill-iteration", lambda: no_replicas.sigkill(r4, i4)),
    ]


def in_process_scenarios(workdir: Path, trials: int, seed: int, device: str = "cpu") -> list[tuple[str, object]]:
    """Per replicated layout: `trials` SIGKILLs of a random rank at a random iteration, one in the
    optimizer step and one in an async save, each run under dtgpt.run (replaced in-process) and,
    for comparison, under a plain torchrun (restart all, resume from last words or a checkpoint).
    Each scenario returns (in-process result, restart-all result). `device`: cuda runs them on
    NCCL (4 GPUs), which is what only GPUs can confirm (docs/faults.md)."""
    rng = random.Random(seed)
    todo = []
    for label, mesh in REPLICATED.items():
        mesh = [*mesh, f"--training.device={device}"]
        replacing = Drill(workdir / label / "replace", 4, layout=mesh, grace=None, label=f"{label}-", launcher="dtgpt.run")
        restarting = Drill(workdir / label / "restart", 4, layout=mesh, grace=None, label=f"{label}-")
        replacing.reference = restarting.reference  # one uninterrupted run per layout
        # The last rank writes the metrics file: it is spared in the step and the save (see last_words_scenarios).
        kills = [(rng.randrange(4), rng.choice(range(2, ITERS)), "iteration", False) for _ in range(trials)]
        kills += [(rng.randrange(3), rng.choice(range(2, ITERS)), "step", False), (rng.randrange(3), 2 * SAVE_INTERVAL, "save", True)]
        if label == "hsdp":  # outside the step: the stop decision (recovered), the evaluation, the timers' reduction and a sync save (last words)
            outside = random.Random(seed + 1)  # a stream of its own: the other scenarios draw what they drew before
            kills += [(outside.randrange(3), outside.choice(range(2, ITERS)), during, False) for during in ("after-step", "eval", "after-step-timed")]
            kills += [(outside.randrange(3), 2 * SAVE_INTERVAL, "save", False)]
        for rank, iteration, during, async_save in kills:
            def both(a=(rank, iteration, during, async_save), x=replacing, y=restarting):
                return x.replace(*a), y.sigkill(*a)

            todo.append((f"in-process-{label}-{kill_kind(during, async_save)}", both))
        if label == "hsdp":  # in-process only: a bug (nothing to compare) and a whole replica (ranks 2 and 3) lost
            todo.append((f"in-process-{label}-bug", lambda x=replacing: (x.bug(1, 5), None)))
            todo.append((f"in-process-{label}-lost-replica", lambda x=replacing: (x.replace(2, 6, also=(3,)), None)))
    return todo
