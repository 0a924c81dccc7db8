"""The Checkpointer's saves in one process (no torchrun): async equals sync, one save in flight,
a failed or truncated save never moves the pointer nor loads, keep_last, and the errors of a
pointer that is a directory or a short write. Its loads: tests/test_checkpoint_unit.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs

from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.export import read_sections
from tests.checkpoints import assert_same, checkpointer, make_trainer, step

# One process and no process group: DCP notes that it saves as a single process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def slow_writes(monkeypatch, seconds: float) -> None:
    """Make DCP's file writes slow, so a save is still in flight while training goes on."""
    original = dcp_fs._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)

    monkeypatch.setattr(dcp_fs._FileSystemWriter, "write_data", write_data)


def held_writes(monkeypatch) -> tuple[threading.Event, list[bool]]:
    """DCP's file writes wait until the returned event is set (at most 120 s), so a save stays in
    flight while training goes on however fast or slow the machine; the list gets True once a
    write has gone through."""
    original, release, written = dcp_fs._FileSystemWriter.write_data, threading.Event(), []

    def write_data(self, plan, planner):
        release.wait(timeout=120)  # a save that held training would hold it this long
        future = original(self, plan, planner)
        written.append(True)
        return future

    monkeypatch.setattr(dcp_fs._FileSystemWriter, "write_data", write_data)
    return release, written


def test_async_save_equals_sync_save_while_training_mutates(tmp_path, monkeypatch):
    sync_root, async_root = tmp_path / "sync", tmp_path / "async"
    t = make_trainer(f"--checkpoint.save={sync_root}")
    step(t, 2)
    checkpointer(t).save(2)
    t.cfg.checkpoint.save, t.cfg.checkpoint.async_save = str(async_root), True
    ckpt = checkpointer(t)
    release, written = held_writes(monkeypatch)
    try:
        ckpt.save(2)
        assert not written, "training was held until the write went through"
        step(t, 2)  # mutates parameters, exp_avg, step counters while the write is in flight
        assert layout.read_pointer(async_root) is None, "pointer moved before the write completed"
        assert not (layout.iteration_dir(async_root, 2) / layout.MARKER).exists()
    finally:
        release.set()
    ckpt.finalize()
    assert layout.read_pointer(async_root) == 2
    a = read_sections(layout.iteration_dir(sync_root, 2))
    b = read_sections(layout.iteration_dir(async_root, 2))
    assert a.keys() == b.keys() == {"model", "optimizer", "train_state", "lr_schedule", "loss_scaler", "rng"}
    for section in a:
        assert_same(a[section], b[section])


def test_async_saves_one_in_flight_and_pointer_follows(tmp_path, monkeypatch):
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.async_save=true", "--checkpoint.keep_last=2")
    ckpt = checkpointer(t)
    slow_writes(monkeypatch, 0.2)
    for i in range(1, 5):
        step(t)
        ckpt.save(i)  # waits for the previous one, which then completes and moves the pointer
        assert layout.read_pointer(tmp_path) == (i - 1 if i > 1 else None)
    ckpt.finalize()
    assert layout.read_pointer(tmp_path) == 4
    assert layout.list_iterations(tmp_path) == [3, 4]  # keep_last=2 pruned 1 and 2


def fail_finish(monkeypatch):
    """DCP writes the data files, then fails before its .metadata: a partial directory."""

    def finish(self, metadata, results):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(dcp_fs._FileSystemWriter, "finish", finish)


def test_failed_save_keeps_pointer_and_is_skipped_on_load(tmp_path, monkeypatch, capsys):
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    step(t)
    ckpt = checkpointer(t)
    ckpt.save(1)
    step(t)
    with monkeypatch.context() as m:
        fail_finish(m)
        with pytest.raises(Exception, match="disk full"):
            ckpt.save(2)
    assert layout.read_pointer(tmp_path) == 1
    assert layout.problem(layout.iteration_dir(tmp_path, 2)) == "no such directory"  # only its staging copy
    assert "no .metadata" in layout.problem(layout.staging_dir(layout.iteration_dir(tmp_path, 2)))
    # a pointer that names the missing directory (e.g. written by hand) falls back to iteration 1
    layout.write_pointer(tmp_path, 2)
    b = make_trainer(f"--checkpoint.load={tmp_path}")
    checkpointer(b)
    assert b.state.progress.iteration == 1
    out = capsys.readouterr().out
    assert "iter_0000002 is not usable" in out and "falling back to" in out


def test_failed_async_save_keeps_pointer_and_finalize_raises(tmp_path, monkeypatch):
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.async_save=true")
    ckpt = checkpointer(t)
    step(t)
    ckpt.save(1)
    ckpt.finalize()
    step(t)
    fail_finish(monkeypatch)
    ckpt.save(2)
    with pytest.raises(CheckpointError, match="disk full"):
        ckpt.finalize()
    assert layout.read_pointer(tmp_path) == 1
    assert not (layout.iteration_dir(tmp_path, 2) / layout.MARKER).exists()


def test_truncated_checkpoint_is_detected(tmp_path, capsys):
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    ckpt = checkpointer(t)
    for i in (1, 2):
        step(t)
        ckpt.save(i)
    data = layout.iteration_dir(tmp_path, 2) / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"load_iteration=2: .* truncated"):
        checkpointer(make_trainer(f"--checkpoint.load={tmp_path}", "--checkpoint.load_iteration=2"))
    b = make_trainer(f"--checkpoint.load={tmp_path}")
    checkpointer(b)
    assert b.state.progress.iteration == 1
    assert "truncated" in capsys.readouterr().out
    # with no complete checkpoint left, a load is an error (starting fresh would replace them)
    (layout.iteration_dir(tmp_path, 1) / layout.MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"none of its completed checkpoints \(iterations \[2\]\) loads now"):
        checkpointer(make_trainer(f"--checkpoint.load={tmp_path}"))


def test_keep_last_never_deletes_pointed_or_newer(tmp_path):
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.keep_last=2")
    ckpt = checkpointer(t)
    for i in range(1, 5):
        step(t)
        ckpt.save(i)
    assert layout.list_iterations(tmp_path) == [3, 4] and layout.read_pointer(tmp_path) == 4
    # an older run's newer checkpoint (iteration 9) is left alone; a stale partial older one goes
    (tmp_path / "iter_0000009").mkdir()
    (tmp_path / "iter_0000002").mkdir()
    step(t)
    ckpt.save(5)
    assert layout.list_iterations(tmp_path) == [4, 5, 9]
    marker = json.loads((layout.iteration_dir(tmp_path, 5) / layout.MARKER).read_text())
    assert marker["iteration"] == 5 and marker["mesh"]["world_size"] == 1
    assert (layout.iteration_dir(tmp_path, 5) / layout.CONFIG).read_text().startswith("[model]")


def test_a_pointer_that_is_a_directory_is_one_clear_error(tmp_path):
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    ckpt = checkpointer(t)
    step(t)
    ckpt.save(1)
    (tmp_path / layout.POINTER).unlink()
    (tmp_path / layout.POINTER).mkdir()
    step(t)
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt is a directory, so the pointer to iteration 2"):
        ckpt.save(2)


def test_a_short_write_is_named_for_what_it_usually_is():
    """torch's zip writer reports a full disk as "unexpected pos"; the save error says what that means."""
    error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    assert layout.describe(error).endswith("(the file came out shorter than written: usually no space left on the device)")
    assert layout.describe(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"


