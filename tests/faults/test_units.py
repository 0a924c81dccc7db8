"""The pieces behind fault tolerance, in one process: the signal flag and its default, fault
injection only on the first attempt, a full disk during a save, the per-sample token-id check
and how a DataLoader worker's data error reaches the command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.cli import is_user_error, one_line, print_error
from dtgpt.config import CheckpointConfig, ConfigError, FaultsConfig, load_config, validate
from dtgpt.data.gpt_dataset import GPTDataset
from dtgpt.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter, check_token_ids
from dtgpt.data.loader import build_data_loader
from dtgpt.faults.signals import SignalFlag, signal_handler_enabled
from dtgpt.checkpoint.integrity import ChecksummingWriter
from dtgpt.faults.faulty_writer import FaultyWriter
from dtgpt.faults.injection import NO_FAULTS, Faults, build_faults
from tests.checkpoints import checkpointer, make_trainer, step


def test_signal_handler_is_on_by_default_exactly_when_saving():
    assert not signal_handler_enabled(CheckpointConfig())
    assert signal_handler_enabled(CheckpointConfig(save="ckpt"))
    assert not signal_handler_enabled(CheckpointConfig(save="ckpt", exit_signal_handler=False))
    assert signal_handler_enabled(CheckpointConfig(exit_signal_handler=True))


def test_signal_flag_records_the_first_signal_and_ignores_the_next(capfd):
    before = signal.getsignal(signal.SIGINT)
    flag = SignalFlag(True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt without the flag
        assert flag.received == signal.SIGTERM
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) is before
    out = capfd.readouterr().out
    assert "received signal SIGTERM: finishing this iteration, then saving" in out
    assert "received signal SIGINT again: ignored" in out


def test_signal_flag_of_a_quiet_rank_records_without_printing(capfd):
    """Ctrl-C under torchrun reaches every rank: only one says so (train.py: rank 0)."""
    flag = SignalFlag(True, announce=False)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.received == signal.SIGINT
    finally:
        flag.restore()
    assert "received signal" not in capfd.readouterr().out


def test_faults_fire_once_on_the_chosen_rank_and_iteration(tmp_path):
    cfg = FaultsConfig(kill_at_iteration=4, kill_rank=1, kill_during_save=True, disk_full_at_iteration=6)
    first, restarted = Faults(cfg, rank=1, restart_count=0), Faults(cfg, rank=1, restart_count=1)
    assert isinstance(first.storage_writer(tmp_path, 4), FaultyWriter) and first.storage_writer(tmp_path, 4).action == "kill"
    assert first.storage_writer(tmp_path, 5) is None
    assert restarted.storage_writer(tmp_path, 4) is None  # torchrun restarted the group: run clean
    assert Faults(cfg, rank=0, restart_count=0).storage_writer(tmp_path, 6).action == "disk_full"
    assert Faults(cfg, rank=1, restart_count=0).storage_writer(tmp_path, 6) is None
    Faults(cfg, rank=1, restart_count=0).in_iteration(4)  # kill_during_save: nothing happens in the iteration itself
    Faults(FaultsConfig(kill_at_iteration=4, kill_during_step=True), rank=0, restart_count=0).in_iteration(4)  # nor here


def test_after_a_killing_save_the_next_iteration_waits_for_the_kill(tmp_path, monkeypatch):
    """An async save's writer kills the rank from a background thread: the main thread must not
    train on meanwhile, or where the death falls would depend on how fast the machine writes. A
    write that fails before the kill releases it (the rank lives on), rather than hanging it."""
    faults = Faults(FaultsConfig(kill_at_iteration=4, kill_during_save=True), rank=0, restart_count=0)
    writer = faults.storage_writer(tmp_path, 4)
    main = threading.Thread(target=faults.in_iteration, args=(5,), daemon=True)
    main.start()
    main.join(timeout=0.5)
    assert main.is_alive()  # still waiting: only the kill, or a failed write, ends it

    def full_disk(self, plan, planner):
        raise OSError("no space left")

    monkeypatch.setattr(ChecksummingWriter, "write_data", full_disk)
    with pytest.raises(OSError, match="no space left"):
        writer.write_data(None, None)
    main.join(timeout=60)
    assert not main.is_alive()


def test_fault_hooks_are_no_ops_unless_faults_are_set_and_nan_poisons_only_its_iteration():
    assert build_faults(FaultsConfig(), rank=0, restart_count=0) is NO_FAULTS
    assert NO_FAULTS.storage_writer(Path("unused"), 1) is None
    faults = build_faults(FaultsConfig(nan_at_iterations=[2]), rank=0, restart_count=1)  # NaN: on every attempt
    model = torch.nn.Linear(3, 2)
    x = torch.ones(1, 3)
    for iteration, finite in ((1, True), (2, False), (3, True)):
        with faults.iteration(iteration, [model]):
            y = model(x)
        assert bool(torch.isfinite(y).all()) == finite, iteration
    assert torch.isfinite(model(x)).all()  # the hook is gone after its iteration


def test_ranks_killed_together_meet_at_a_store_barrier_before_dying(monkeypatch):
    """kill_rank and kill_also_ranks die only once all of them reached the kill, so the launcher
    sees one event however far apart the machine's load puts their arrivals (SETTLE_S is 1 s)."""
    from dtgpt.faults import injection

    killed: list[int] = []
    monkeypatch.setattr(injection, "_kill", lambda rank, where: killed.append(rank))
    store = torch.distributed.HashStore()
    cfg = FaultsConfig(kill_at_iteration=10, kill_rank=2, kill_also_ranks=[3])
    first = threading.Thread(target=Faults(cfg, rank=2, restart_count=0, store=store).in_iteration, args=(10,))
    first.start()
    store.wait(["dtgpt/faults/killed/10"], timedelta(seconds=60))  # rank 2 has arrived...
    assert killed == []  # ...and waits for rank 3
    Faults(cfg, rank=3, restart_count=0, store=store).in_iteration(10)
    first.join(timeout=60)
    assert not first.is_alive() and sorted(killed) == [2, 3]
    alone = torch.distributed.HashStore()  # one rank killed: it waits for nobody
    Faults(FaultsConfig(kill_at_iteration=10, kill_rank=1), rank=1, restart_count=0, store=alone).in_iteration(10)
    assert killed[-1] == 1 and not alone.check(["dtgpt/faults/killed/10"])


def test_fault_ranks_are_validated():
    with pytest.raises(ConfigError, match=r"faults.hang_rank=2 must be < the world size 2"):
        validate(load_config(None, ["--data.mock_data=true", "--faults.hang_rank=2"]), world_size=2)
    with pytest.raises(ConfigError, match=r"faults.signal_name='SIGHUP' is not one of"):
        load_config(None, ["--data.mock_data=true", "--faults.signal_name=SIGHUP"])
    with pytest.raises(ConfigError, match=r"distributed.heartbeat_min_seconds=0.0 must be > 0"):
        load_config(None, ["--data.mock_data=true", "--distributed.heartbeat_min_seconds=0"])


@pytest.mark.slow
def test_disk_full_during_save_leaves_pointer_and_previous_checkpoint(tmp_path):
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--faults.disk_full_at_iteration=2")
    ckpt = checkpointer(t)
    step(t)
    ckpt.save(1)
    step(t)
    with pytest.raises(CheckpointError, match=r"iter_0000002 failed: rank 0: OSError: \[Errno 28\] No space left"):
        ckpt.save(2)
    assert layout.read_pointer(tmp_path) == 1 and layout.problem(layout.iteration_dir(tmp_path, 1)) is None
    assert "no .metadata" in layout.problem(layout.staging_dir(layout.iteration_dir(tmp_path, 2)))
    step(t)
    ckpt.save(3)  # the disk has room again: the next save works and the pointer moves on
    assert layout.read_pointer(tmp_path) == 3


@pytest.fixture
def late_bad_id(tmp_path):
    """60 documents of valid ids; one id 999 far from the start of the file."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "docs") as writer:
        for d in range(60):
            tokens = rng.integers(0, 100, 20)
            if d == 50:
                tokens[7] = 999
            writer.add_document(tokens)
    return IndexedDataset(tmp_path / "docs")


def test_a_bad_id_past_the_startup_scan_is_caught_in_its_sample(late_bad_id):
    check_token_ids(late_bad_id, 128, num_tokens=500)  # the scan sees only the start: passes
    with pytest.raises(DataError, match=r"token ids \[999\] \(first at token 1007"):
        check_token_ids(late_bad_id, 128)
    ds = GPTDataset(late_bad_id, (0, 60), 70, 16, 1234, cache_dir=None, vocab_size=128)
    with pytest.raises(DataError, match=r"docs.bin: sample \d+ of the train split holds token ids \[999\] outside"):
        for i in range(len(ds)):
            ds[i]
    unchecked = GPTDataset(late_bad_id, (0, 60), 70, 16, 1234, cache_dir=None)
    assert max(int(unchecked[i].max()) for i in range(len(unchecked))) == 999


def test_a_data_error_in_a_loader_worker_becomes_one_line(late_bad_id):
    ds = GPTDataset(late_bad_id, (0, 60), 70, 16, 1234, cache_dir=None, vocab_size=128)
    loader = build_data_loader(ds, 0, lambda _: 70, 0, 1, num_workers=1)
    with pytest.raises(DataError) as info:
        list(loader)
    assert "Original Traceback" in str(info.value) and is_user_error(info.value)
    line = one_line(str(info.value))
    assert line.startswith(f"{late_bad_id.prefix}.bin: sample ") and "\n" not in line


def test_a_bug_is_not_a_user_error():
    assert not is_user_error(RuntimeError("shape mismatch in matmul"))
    wrapped = RuntimeError("rank 0: save-checkpoint of iteration 3 failed")
    wrapped.__cause__ = CheckpointError("disk full")
    assert is_user_error(wrapped)


def test_an_error_line_is_one_write_so_ranks_cannot_interleave(monkeypatch, capfd):
    """Every rank of a job shares stderr: a line written in two pieces (text, then newline) was
    once glued to another rank's line. print_error must hand the whole line to one write."""
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append((fd, data)) or real_write(fd, data))
    print_error("rank 1: save-checkpoint of iteration 6 failed")
    assert writes == [(sys.stderr.fileno(), b"error: rank 1: save-checkpoint of iteration 6 failed\n")]
    assert capfd.readouterr().err == "error: rank 1: save-checkpoint of iteration 6 failed\n"


def test_a_rank_that_crashes_in_native_code_prints_its_python_stacks(tmp_path):
    """train.py's run_main enables faulthandler: a segfault prints every thread's Python stack (the
    crashed rank's only account of itself under torchrun, which reports just the signal)."""
    crash = ("import faulthandler, sys\nfrom dtgpt.cli import run_main\n"
             "run_main(['--print-config'], None, None)\nfaulthandler._sigsegv()\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}, timeout=120)  # fmt: skip
    assert proc.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in proc.stderr and 'File "<string>", line 4' in proc.stderr, proc.stderr


THREADS_AFTER_RUN = """
import os, sys
import train
from dtgpt.cli import run_main
status = run_main(sys.argv[1:], train.model_provider, train.datasets_provider)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(f"rank {os.environ['RANK']}: {sum(n.startswith(('pt_gloo', 'gloo_')) for n in names)} gloo threads after the run")
sys.exit(status)
"""


@pytest.mark.slow  # a 2-rank torchrun, about 15 s
def test_a_finished_run_leaves_no_gloo_thread_running(tmp_path):
    """After pretrain() the groups are gone, threads joined: DTensor's caches keep the meshes, and
    each mesh its groups, unless shutdown() empties the meshes' registries (ParallelDims.release_groups)."""
    script = tmp_path / "threads_after_run.py"
    script.write_text(THREADS_AFTER_RUN)
    repo = Path(__file__).parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
         "--config", str(repo / "configs" / "debug.toml"), "--training.train_iters=1", "--eval.eval_iters=0",
         "--parallel.tensor_model_parallel_size=2", "--checkpoint.save=", "--checkpoint.load=", "--logging.tensorboard_dir="],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    counts = sorted(line for line in proc.stdout.splitlines() if "gloo threads after the run" in line)
    assert counts == [f"rank {r}: 0 gloo threads after the run" for r in range(2)], proc.stdout[-2000:]


def test_exit_process_ends_with_an_idle_executor_alive(tmp_path):
    """exit_process stops what the teardown would stop first: an executor's idle worker threads
    (torch.compile keeps a pool) are not daemons, and joining them without telling them to stop
    would wait forever."""
    code = ("from concurrent.futures import ThreadPoolExecutor\nfrom dtgpt.cli import exit_process\n"
            "pool = ThreadPoolExecutor(2)\npool.submit(print, 'worked')\nexit_process(3)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}, timeout=60)  # fmt: skip
    assert proc.returncode == 3 and proc.stdout == "worked\n", proc.stdout + proc.stderr
