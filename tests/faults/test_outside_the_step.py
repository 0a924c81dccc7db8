"""A rank killed outside the train step, under `python -m dtgpt.run` on 2 CPU ranks (dp_replicate
2, dropout on, every default timeout): in the checks between iterations (the stop decision) and
from an async save's thread it is recovered in-process (the survivor keeps its process; the
logging rank killed after its step and before its line: its replacement writes that line); in the
evaluation, the timers' reduction, a synchronous checkpoint save, the final save and the final
evaluation, one line says that phase is not redone, last words save the completed iteration
(unless saved already), the survivor exits without a traceback and the launcher restarts both
ranks, which resume from it (after the last iteration: to do the final save or evaluation).
Either way every iteration is recorded once and every loss and gradient norm equals an
uninterrupted run's bitwise. The eight killed jobs and the uninterrupted one run at once: one
wait instead of nine (docs/faults.md, "Outside the step")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.faults.test_in_process import BASE, _descendants, _rank_of, records
from tests.runs import REPO, selected_cases

pytestmark = pytest.mark.slow  # nine 2-rank jobs under dtgpt.run

ITERS, AT, KILLED = 8, 4, 0  # rank 1, the logging rank, survives to record the iteration of the kill
LOGGING_RANK = 1
SAVE_INTERVAL = AT  # the async save of AT has the iterations up to the next save to die in
REPLICAS = ["--parallel.data_parallel_replicate_size=2", "--parallel.data_parallel_shard_size=1"]
KILL = [f"--faults.kill_at_iteration={AT}", f"--faults.kill_rank={KILLED}"]
FALLBACK = "in-process recovery: none (a rank failed during the {}, which is not redone); last words follow"
RECOVERED = "in-process recovery: rank(s) [{}] replaced, the others kept their state; iteration {} is redone"
LAST = [f"--faults.kill_at_iteration={ITERS}"]  # (a later setting overrides KILL's)
PHASES = {  # name -> (its faults and settings, the line it prints (a regular expression), recovered in-process)
    "stop-decision": (["--faults.kill_after_step=true"], re.escape(RECOVERED.format(KILLED, AT + 1)), True),
    # the logging rank, after the step of AT and before its line: its replacement writes AT's record, once
    "logging-rank-after-step": (["--faults.kill_after_step=true", f"--faults.kill_rank={LOGGING_RANK}"],
                                re.escape(RECOVERED.format(LOGGING_RANK, AT + 1)), True),  # fmt: skip
    "evaluation": (["--faults.kill_during_eval=true", "--eval.eval_iters=1", "--eval.eval_interval=2"],
                   re.escape(FALLBACK.format("evaluation")), False),  # fmt: skip
    "timers": (["--faults.kill_after_step=true", "--logging.timers_log_level=1"],
               re.escape(FALLBACK.format("timers' reduction")), False),  # fmt: skip
    "sync-save": (["--faults.kill_during_save=true"], re.escape(FALLBACK.format("checkpoint save")), False),
    "async-save": (["--faults.kill_during_save=true", "--checkpoint.async_save=true"],
                   re.escape(RECOVERED.format(KILLED, AT + 1)), True),  # fmt: skip
    # after the last iteration: the final save (no regular save falls on ITERS) and the final
    # validation (no regular evaluation falls on ITERS); the restart has nothing to train and does them
    "final-save": ([*LAST, "--faults.kill_during_save=true", f"--checkpoint.save_interval={ITERS - 1}"],
                   re.escape(FALLBACK.format("final checkpoint save")), False),  # fmt: skip
    "final-evaluation": ([*LAST, "--faults.kill_during_eval=true", "--eval.eval_iters=1", f"--eval.eval_interval={ITERS - 1}"],
                         re.escape(FALLBACK.format("final evaluation")), False),  # fmt: skip
}
FINAL_VALIDATION = f" validation loss at iteration {ITERS} | "


def argv(where: Path, extra: list[str]) -> list[str]:
    return [str(REPO / "train.py"), *BASE, *REPLICAS, f"--training.train_iters={ITERS}", f"--checkpoint.save_interval={SAVE_INTERVAL}",
            f"--checkpoint.save={where / 'ckpt'}", f"--checkpoint.load={where / 'ckpt'}",
            f"--logging.metrics_file={where / 'metrics.jsonl'}", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict[str, tuple[int, str, dict[int, set[int]], Path]]:
    """The selected jobs and the reference, launched together: {name: (exit status, output,
    worker PIDs per rank, directory)}."""
    root = tmp_path_factory.mktemp("outside")
    names = selected_cases(request, test_a_death_outside_the_step_is_recovered_or_falls_back_in_one_line)
    todo = {"reference": [], **{name: [*KILL, *PHASES[name][0]] for name in names}}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for name, extra in todo.items():
        where = root / name
        where.mkdir()
        cmd = [sys.executable, "-m", "dtgpt.run", "--standalone", "--nproc-per-node", "2", "--max-restarts=2", *argv(where, extra)]
        procs[name] = subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: dict[str, dict[int, set[int]]] = {name: {} for name in procs}
    done = threading.Event()

    def watch():
        while not done.wait(1.0):
            for name, proc in procs.items():
                for pid in _descendants(proc.pid):
                    rank = _rank_of(pid)
                    if rank is not None:
                        pids[name].setdefault(rank, set()).add(pid)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outputs = {}
    try:
        for name, proc in procs.items():
            outputs[name], _ = proc.communicate(timeout=900)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        done.set()
        watcher.join()
    for name, out in outputs.items():
        (root / name / "run.log").write_text(out)
    return {name: (procs[name].returncode, outputs[name], pids[name], root / name) for name in procs}


@pytest.mark.parametrize("name", list(PHASES))
def test_a_death_outside_the_step_is_recovered_or_falls_back_in_one_line(jobs, name):
    settings, line, in_process = PHASES[name]
    at = ITERS if LAST[0] in settings else AT
    killed = LOGGING_RANK if f"--faults.kill_rank={LOGGING_RANK}" in settings else KILLED
    rc, log, pids, where = jobs[name]
    assert rc == 0, log[-6000:]
    assert f"fault: SIGKILL to rank {killed}" in log, log[-6000:]
    assert len(re.findall(line, log)) == 1, log[-6000:]
    assert log.count("in-process recovery: none") + log.count("is redone") == 1, log[-6000:]
    assert "Traceback" not in log, log[-6000:]  # the survivor leaves on the one line (and last words)
    if in_process:
        assert "last words" not in log and "loaded checkpoint" not in log, log[-6000:]
        assert len(pids[1 - killed]) == 1 and len(pids[killed]) == 2, pids  # the survivor kept its process
        printed = [len(re.findall(rf"\] iteration +{i}/ +{ITERS} \|", log)) for i in range(1, ITERS + 1)]
        assert printed == [1] * ITERS, log[-6000:]  # each iteration's log line once, the killed logging rank's too
    else:
        # last words save the completed iteration, but not twice: the final save had it already
        said = f"iteration {at} is saved already" if name == "final-evaluation" else f"saved iteration {at} to"
        assert said in log and f": iteration {at}," in log, log[-6000:]  # then the restart resumed from it
        # the launcher restarted both (rank 0 may have had a replacement in between)
        assert len(pids[1]) == 2 and len(pids[0]) >= 2, pids
    reference_rc, reference_log, _, reference_dir = jobs["reference"]
    assert reference_rc == 0, reference_log[-6000:]
    got, want = records(where / "metrics.jsonl"), records(reference_dir / "metrics.jsonl")
    assert [i for i, *_ in got] == list(range(1, ITERS + 1))  # every iteration recorded once
    assert got == want  # bitwise: loss and gradient norm
    if at == ITERS:  # the restart did what was interrupted: the final save is whole, the final validation logged once
        assert (where / "ckpt" / f"iter_{ITERS:07d}").is_dir() and "nothing to train" in log, log[-6000:]
        assert log.count(FINAL_VALIDATION) == ("--eval.eval_iters=1" in settings), log[-6000:]
