"""Recovery from faults, on 2 CPU ranks under torchrun: the scenarios of scripts/fault_drill.py.

Each scenario injects one fault (`[faults]` keys, or a real signal to torchrun) into a tiny GPT
run that checkpoints every 3 of 12 iterations with checkpoint.load == checkpoint.save, and
compares the per-iteration losses with an uninterrupted run on the same mesh: bitwise equal
(dropout on, so the RNG must come back too). One deterministic trial of each kind that matters
most, then the drill's remaining scenarios; `make test` (and CI) runs them all, `make test-fast`
only the SIGKILL mid-iteration (the others are @slow).
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from dtgpt.checkpoint import layout
from tests.runs import REPO


def load_drill():
    spec = importlib.util.spec_from_file_location("fault_drill", REPO / "scripts/fault_drill.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fault_drill = load_drill()


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    return fault_drill.Drill(tmp_path_factory.mktemp("drill"), nproc=2)


def explain(result) -> str:
    return f"{result.row()}\n" + "\n".join(r.log[-4000:] for r in result.runs)


def test_sigkill_mid_iteration_restarts_and_resumes_bitwise(drill):
    """Rank 1 dies in iteration 5; a plain torchrun --max-restarts=1 (its shared TCPStore, no
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE) restarts the group, which resumes from iteration 3 (the
    newest complete checkpoint) and finishes with the reference losses."""
    assert fault_drill.OPT_OUT not in fault_drill.plain_env()
    result = drill.sigkill(rank=1, iteration=5)
    assert result.ok, explain(result)
    assert result.outcome.endswith("restarted, resumed from 3") and result.lost == 1  # iteration 4 ran twice
    assert "last words: none (no replicas: parallel.data_parallel_replicate_size=1" in result.runs[0].log
    assert result.equal and result.intact


@pytest.mark.slow
def test_sigint_to_one_rank_stops_every_rank_and_exits_zero(drill):
    """One rank gets SIGINT in iteration 5 (then SIGTERM and SIGINT again while it saves): every
    rank finishes iteration 5, the checkpoint is complete, every worker exits 0 (so torchrun
    does), and the next launch continues with the reference losses."""
    result = drill.signal_one_rank(rank=0, iteration=5, sig="SIGINT")
    stopped = result.runs[0]
    assert stopped.rc == 0, explain(result)
    assert stopped.log.count("received signal SIGINT: finishing this iteration") == 1
    assert stopped.log.count("again: ignored") == 2  # the second and third signal, during the save
    assert stopped.log.count("> training stopped: exit signal received") == 1
    assert not re.search(r"iteration\s+6/", stopped.log)  # nobody went on to iteration 6
    assert result.ok and result.lost == 0 and result.equal, explain(result)


@pytest.mark.slow
def test_sigterm_to_torchrun_is_forwarded_and_every_rank_saves(drill):
    """A preemption: SIGTERM to torchrun, which forwards it to its workers; they finish the
    iteration, save it (the pointer moves to it) and stop; the relaunch resumes exactly."""
    result = drill.stop_signal("SIGTERM", after=4)
    stopped = result.runs[0]
    # every rank got it; rank 0 says so, once (a rank that alone gets one says nothing: the stop line does)
    assert stopped.log.count("received signal SIGTERM: finishing this iteration") == 1, explain(result)
    assert stopped.log.count("> training stopped: exit signal received") == 1, explain(result)
    saved = [int(m) for m in re.findall(r"saved checkpoint \S+iter_(\d+)", stopped.log)]
    logged = [int(m) for m in re.findall(r"\] iteration\s+(\d+)/", stopped.log)]
    assert saved and saved[-1] == max(logged) >= 4, explain(result)  # the last iteration run is saved
    assert result.ok and result.lost == 0 and result.equal and result.intact, explain(result)


@pytest.mark.slow
def test_hang_times_out_naming_rank_phase_iteration_with_heartbeats(drill, tmp_path):
    """Rank 1 sleeps forever in iteration 4. Rank 0 prints heartbeat lines, then its collective
    times out after distributed.timeout_minutes (15 s): the error names rank 0, the phase and the
    iteration, and the job ends by itself instead of hanging (the drill kills a job that outlives
    its launch's timeout, and says so in the log)."""
    args = ["--faults.hang_at_iteration=4", "--faults.hang_rank=1", *fault_drill.HANG_LIMITS]
    run = drill.launch(tmp_path, "hang", args, restarts=0, timeout=300)
    assert "fault drill: killed after" not in run.log, run.log[-3000:]
    assert run.rc != 0
    assert "fault: rank 1 hangs in iteration 4" in run.log
    assert re.search(r"heartbeat: rank 0 has been in 'train-step' of iteration 4 for \d+ s", run.log), run.log[-3000:]
    assert re.search(r"TrainingError: rank 0: train-step of iteration 4 failed: .*Timed out", run.log), run.log[-3000:]
    assert run.log.index("heartbeat: rank 0") < run.log.index("TrainingError: rank 0")


@pytest.mark.slow
def test_disk_full_during_save_keeps_the_previous_checkpoint(drill):
    """ENOSPC on rank 1 while writing iteration 6: one clear error line per rank, exit status 2,
    the pointer still names iteration 3, which is complete; the relaunch resumes from it."""
    result = drill.disk_full(rank=1, iteration=6)
    failed = result.runs[0]
    errors = [ln for ln in failed.log.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 2 and all("rank 1: OSError: [Errno 28] No space left on device" in e for e in errors), explain(result)
    assert "save-checkpoint of iteration 6" in errors[0] and "latest_checkpointed_iteration.txt not moved" in errors[0]
    assert result.ok and result.equal and result.lost == 3, explain(result)
    assert "loaded checkpoint" in result.runs[1].log and "iteration 3, consumed samples 24" in result.runs[1].log


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_during_save_falls_back_to_the_previous_checkpoint(drill, async_save):
    result = drill.sigkill(rank=0, iteration=6, during="save", async_save=async_save)
    assert result.ok and result.outcome.endswith("restarted, resumed from 3"), explain(result)
    # The rank dies before iteration 7 starts: 4, 5, 6 run twice. An async save's kill lands in its
    # background thread, and the main thread waits for it at the start of iteration 7 (however
    # slowly a loaded machine writes), so the count is the same.
    assert result.lost == 3, explain(result)


@pytest.mark.slow
def test_ctrl_c_to_the_whole_group(drill):
    """SIGINT to torchrun and its workers at once (a terminal's Ctrl-C): each worker sees it twice."""
    result = drill.stop_signal("SIGINT", whole_group=True)
    assert result.ok and result.lost == 0, explain(result)


@pytest.mark.slow
def test_hang_then_restart_recovers(drill):
    result = drill.hang(rank=0, iteration=5)
    assert result.ok, explain(result)


@pytest.mark.slow
def test_nan_batch_is_skipped(drill):
    result = drill.nan_batch(iteration=5)
    assert result.ok, explain(result)


@pytest.mark.slow
def test_deleted_shard_falls_back(drill):
    result = drill.deleted_shard()
    assert result.ok and result.lost == 3, explain(result)
    assert layout.read_pointer(drill.workdir / "deleted-shard" / "ckpt") == fault_drill.ITERS


@pytest.mark.slow
def test_corrupt_idx_is_refused(drill):
    result = drill.corrupt_idx()
    assert result.ok, explain(result)


@pytest.mark.slow
def test_random_sigkill_trials(drill):
    for name, scenario in fault_drill.scenarios(drill, trials=2, seed=1)[:2]:
        result = scenario()
        assert result.ok, explain(result)


def test_our_traceback_frames_are_decided_by_module_location(tmp_path):
    """A frame counts as ours only if its file lies in the dtgpt package (or is train.py); a
    checkout or virtual environment under a folder named `dtgpt` is somebody else's code."""
    package = REPO / "dtgpt"
    foreign = tmp_path / "dtgpt" / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "run.py"
    log = "\n".join([
        "Traceback (most recent call last):",
        f'  File "{foreign}", line 10, in main',
        f'  File "{tmp_path / "dtgpt" / "scripts" / "other.py"}", line 3, in <module>',
        f'  File "{package / "training.py"}", line 5, in pretrain',
        f'  File "{REPO / "train.py"}", line 7, in <module>',
        "error: corpus.idx is corrupt",
    ])  # fmt: skip
    ours = fault_drill.our_traceback_frames(log)
    assert [line.split('"')[1] for line in ours] == [str(package / "training.py"), str(REPO / "train.py")]
    assert fault_drill.our_traceback_frames(log.replace(str(package), str(tmp_path / "dtgpt" / "dtgpt"))) == [ours[1]]
