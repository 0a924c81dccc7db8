"""Checkpoints are data, not code, and nothing overwrites a good checkpoint (issue 21).

One test per category: crafted pickles run no code in any entry point; damaged files make a
checkpoint partial (the fallback takes the older one); each way a good checkpoint used to be
lost now leaves it loadable; out-of-range settings and bad files are one line.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.lock import SaveDirLock
from dtgpt.checkpoint.safe import SafeReader
from dtgpt.config import ConfigError, load_config
from dtgpt.training import SkippedTooOftenError, check_skipped
from dtgpt.state import RunHealth
from tests.runs import TINY, TRAIN, load_script, read_metrics, run_train
from tests.checkpoints import SMALL, checkpointer, make_trainer, step


def _text(s: str) -> bytes:
    data = s.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def crafted_pickle(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle that calls module.name(arg) when loaded (STACK_GLOBAL, TUPLE1, REDUCE)."""
    return b"\x80\x04" + _text(module) + _text(name) + b"\x93" + _text(arg) + b"\x85R."


class Payload:
    """Pickled as `exec(code)`: creates the marker file if it is ever unpickled."""

    def __init__(self, marker):
        self.code = f"open({str(marker)!r}, 'w').close()"

    def __reduce__(self):
        return exec, (self.code,)


def saved_checkpoint(root, iterations=(1, 2)):
    t = make_trainer(f"--checkpoint.save={root}", "--model.hidden_dropout=0.0")
    ckpt = checkpointer(t)
    for i in iterations:
        step(t)
        ckpt.save(i)
    ckpt.finalize()
    return t


def reseal(directory) -> None:
    """Rewrite the marker over the current files, as an attacker who controls them all would."""
    layout.write_marker(directory, layout.read_marker(directory) | {"checksums": None})


def plant_metadata_payload(directory, marker, dotted: bool) -> None:
    code = f"open({str(marker)!r}, 'w').close()"
    if dotted:  # a name that resolves through an allowed module's own imports
        data = crafted_pickle("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}")
    else:
        data = crafted_pickle("builtins", "exec", code)
    (directory / layout.DCP_METADATA).write_bytes(data)
    reseal(directory)


def plant_item_payload(directory, marker) -> None:
    """Re-save the directory's tensors plus one pickled object, as a tampered checkpoint would hold."""
    from dtgpt.checkpoint.export import read_sections

    sections = read_sections(directory)
    sections["train_state"]["note"] = Payload(marker)
    for path in directory.iterdir():
        if path.name != layout.CONFIG:
            path.unlink()
    with layout.single_process():
        dcp.save(sections, checkpoint_id=str(directory), no_dist=True)
    layout.write_marker(directory, {"format": layout.FORMAT, "iteration": 2, "mesh": None, "tied": True})


ENTRY_POINTS = ["load", "load_weights_only", "auto_resume", "to-torch", "to-hf", "generate"]


def run_entry_point(kind: str, root, tmp_path, capfd) -> str:
    """Read the checkpoint under root the way `kind` does; returns its one error line."""
    if kind in ("load", "load_weights_only", "auto_resume"):
        args = {"load": [f"--checkpoint.load={root}"], "load_weights_only": [f"--checkpoint.load={root}",
                "--checkpoint.load_optimizer=false"], "auto_resume": [f"--checkpoint.save={root}", "--checkpoint.auto_resume=true"]}[kind]  # fmt: skip
        with pytest.raises(CheckpointError) as e:
            checkpointer(make_trainer(*args))
        return str(e.value)
    if kind == "generate":
        argv = [str(root), "--prompt", "1 2", "--max-new-tokens", "2"]
        script = load_script("generate")
    else:
        argv = [kind, str(root), str(tmp_path / f"out-{kind}")]
        script = load_script("convert_checkpoint")
    capfd.readouterr()
    assert script.main(argv) == 2
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("where", ["metadata_exec", "metadata_dotted_name", "pickled_item"])
def test_crafted_checkpoint_runs_no_code_in_any_entry_point(tmp_path, capfd, where):
    root = tmp_path / "ckpt"
    saved_checkpoint(root, iterations=(2,))
    marker = tmp_path / "PWNED"
    directory = layout.iteration_dir(root, 2)
    if where == "pickled_item":
        plant_item_payload(directory, marker)
    else:
        plant_metadata_payload(directory, marker, dotted=where == "metadata_dotted_name")
    for kind in ENTRY_POINTS:
        message = run_entry_point(kind, root, tmp_path, capfd)
        assert "refusing" in message and str(directory) in message, (kind, message)
        assert not marker.exists(), f"{kind} ran the payload"
    # the reader itself refuses a pickled item even when the metadata check is bypassed
    if where == "pickled_item":
        from dtgpt.checkpoint.safe import load_metadata

        flat = {k: None for k in load_metadata(directory / layout.DCP_METADATA).state_dict_metadata if "note" in k}
        with pytest.raises(CheckpointException, match="pickled object"), layout.single_process():
            dcp.load(flat, checkpoint_id=str(directory), storage_reader=SafeReader(directory), no_dist=True)
        assert not marker.exists()


@pytest.mark.parametrize("damage", ["tensor_bytes", "pointer_not_integer", "pointer_not_utf8", "garbage_marker",
                                    "marker_not_object", "metadata_garbage", "unreadable_file"])  # fmt: skip
def test_damaged_newest_checkpoint_falls_back_to_the_intact_older_one(tmp_path, capsys, damage):
    root = tmp_path / "ckpt"
    saved_checkpoint(root)
    newest = layout.iteration_dir(root, 2)
    data = newest / "__0_0.distcp"
    if damage == "tensor_bytes":  # same size, different bytes: only the checksum sees it
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2 : len(raw) // 2 + 64] = b"\x7f" * 64
        data.write_bytes(bytes(raw))
    elif damage == "pointer_not_integer":
        (root / layout.POINTER).write_text("two\n")
        (newest / layout.MARKER).unlink()
    elif damage == "pointer_not_utf8":
        (root / layout.POINTER).write_bytes(b"\xff\xfe2\n")
        (newest / layout.MARKER).write_text("not json")
    elif damage == "garbage_marker":
        (newest / layout.MARKER).write_bytes(b"\x00\xff{garbage")
    elif damage == "marker_not_object":
        (newest / layout.MARKER).write_text("[1, 2]")
    elif damage == "metadata_garbage":
        (newest / layout.DCP_METADATA).write_bytes(b"\x80\x04garbage")
        reseal(newest)
    else:
        data.chmod(0)
        if os.access(data, os.R_OK):  # root reads anything: emulate with a directory in its place
            data.chmod(0o644)
            data.unlink()
            data.mkdir()
    b = make_trainer(f"--checkpoint.load={root}", "--model.hidden_dropout=0.0")
    checkpointer(b)
    assert b.state.progress.iteration == 1
    assert "falling back to" in capsys.readouterr().out


def test_unreadable_checkpoints_are_never_replaced_by_a_fresh_start(tmp_path):
    """Data loss (1): with iter_* directories of which none loads, auto-resume stops instead of
    starting from scratch (whose saves would have replaced them)."""
    root = tmp_path / "ckpt"
    saved_checkpoint(root)
    for i in (1, 2):
        (layout.iteration_dir(root, i) / layout.DCP_METADATA).write_bytes(b"transient read error")
    for args in ([f"--checkpoint.save={root}", "--checkpoint.auto_resume=true"], [f"--checkpoint.save={root}", f"--checkpoint.load={root}"]):
        with pytest.raises(CheckpointError, match=r"none of its completed checkpoints \(iterations \[1, 2\]\) loads now.*refusing to start from scratch"):
            checkpointer(make_trainer(*args))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == ["iter_0000001", "iter_0000002"]


def test_a_run_that_did_not_load_from_a_directory_does_not_write_into_it(tmp_path):
    """Data loss (2): a fresh run pointed at an old save directory stops; overwrite=true lets it."""
    root = tmp_path / "ckpt"
    a = saved_checkpoint(root)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(iterations 1..2\).*checkpoint.overwrite=true"):
        checkpointer(make_trainer(f"--checkpoint.save={root}"))
    with pytest.raises(CheckpointError, match="already holds checkpoints"):  # loading elsewhere is no resume
        checkpointer(make_trainer(f"--checkpoint.save={root}", f"--checkpoint.load={tmp_path / 'empty'}", "--checkpoint.auto_resume=true"))
    b = make_trainer(f"--checkpoint.load={root}", "--model.hidden_dropout=0.0")
    checkpointer(b)
    assert b.state.progress.iteration == 2
    assert all(torch.equal(x, y) for x, y in zip(a.state.model.parameters(), b.state.model.parameters()))
    c = make_trainer(f"--checkpoint.save={root}", "--checkpoint.overwrite=true")
    checkpointer(c).finalize()  # allowed, and nothing is written before its first save


@pytest.mark.slow
def test_a_second_run_on_the_same_save_directory_gets_one_line_naming_the_holder(tmp_path):
    """Data loss (3): two runs saving into one directory. The lock is per open file, so a second
    Checkpointer in this process is refused like another process would be."""
    root = tmp_path / "ckpt"
    t = make_trainer(f"--checkpoint.save={root}")
    first = checkpointer(t)
    with pytest.raises(CheckpointError, match=rf"checkpoint.save={root} is in use by another run \(run {first.run_id}, pid {os.getpid()}"):
        checkpointer(make_trainer(f"--checkpoint.save={root}"))
    first.finalize()  # releases it, and removes the directory it created: it holds nothing
    assert not root.exists()
    root.mkdir()
    SaveDirLock(root, "next").release()
    # another process: the same one line, and exit code 2
    holder = SaveDirLock(root, "holder")
    try:
        proc = subprocess.run(
            [sys.executable, TRAIN, *SMALL, f"--checkpoint.save={root}", "--training.train_iters=1"],
            cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        holder.release()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "in use by another run (run holder" in proc.stderr
    assert not layout.list_iterations(root)


def test_non_finite_weights_prune_nothing_and_consecutive_skips_stop_the_run(tmp_path, capsys):
    """Data loss (4): weights gone NaN are saved, but keep_last prunes no good checkpoint then;
    and a run whose iterations are all skipped stops with one line."""
    root = tmp_path / "ckpt"
    t = make_trainer(f"--checkpoint.save={root}", "--checkpoint.keep_last=1", "--model.hidden_dropout=0.0")
    ckpt = checkpointer(t)
    step(t)
    ckpt.save(1)
    with torch.no_grad():
        next(iter(t.state.model.parameters())).fill_(float("nan"))
    for i in (2, 3):
        step(t)
        ckpt.save(i)
    ckpt.finalize()
    assert layout.list_iterations(root) == [1, 2, 3]
    assert "saved non-finite weights: no older checkpoint is pruned" in capsys.readouterr().out
    b = make_trainer(f"--checkpoint.load={root}", "--checkpoint.load_iteration=1")
    checkpointer(b)
    assert all(torch.isfinite(p).all() for p in b.state.model.parameters())
    check_skipped(2, 3, 10)
    check_skipped(5, 0, 10)
    with pytest.raises(SkippedTooOftenError, match=r"last 3 iterations \(up to 12\) were all skipped.*exit_skipped_iters=3"):
        check_skipped(3, 3, 12)


@pytest.mark.slow
def test_an_exploding_run_prunes_no_good_checkpoint_and_stops_in_one_line(tmp_path):
    """Data loss (4b): resumed with optimizer.lr=1e30 (finite, so accepted), iteration 5 makes the
    weights huge but finite and every later loss is NaN. Its saves (6, 8) are finite weights
    yet follow a non-finite loss: they neither prune nor count toward keep_last=1, so 2 and 4
    stay; exit_skipped_iters=5 stops the run at iteration 10 (6..10 skipped) with one line."""
    root = tmp_path / "ckpt"
    every_2 = [*TINY, f"--checkpoint.save={root}", "--checkpoint.save_interval=2", "--logging.log_interval=1"]
    run_train(tmp_path, [*every_2, "--training.train_iters=4"], name="good")
    assert layout.list_iterations(root) == [2, 4]
    metrics = tmp_path / "bad.jsonl"
    proc = run_train(tmp_path, [*every_2, f"--checkpoint.load={root}", "--optimizer.lr=1e30", "--checkpoint.keep_last=1",
                                "--optimizer.override_opt_param_scheduler=true", "--training.exit_skipped_iters=5", f"--logging.metrics_file={metrics}"], name="bad", check=False)  # fmt: skip
    records = read_metrics(metrics)
    assert records[0]["iteration"] == 5 and math.isfinite(records[0]["loss"]) and records[0]["skipped"] == 0
    assert [r["skipped"] for r in records[1:]] == [1, 2, 3, 4, 5]  # 6..10: the loss is no longer finite
    assert layout.list_iterations(root) == [2, 4, 6, 8]
    for i in (6, 8):
        marker = layout.read_marker(layout.iteration_dir(root, i))
        assert marker["weights_finite"] and not marker["counts_for_keep_last"]
        assert f"iteration {i} follows a non-finite loss: no older checkpoint is pruned" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: the last 5 iterations (up to 10) were all skipped") and "exit_skipped_iters=5" in errors[0]


def test_a_save_counts_toward_keep_last_after_an_optimizer_step_on_a_finite_loss():
    health = RunHealth()  # a fresh (or loaded) state is sound
    assert health.verdict(weights_finite=True).counts
    health.record(skipped=True, loss_finite=True)  # an fp16 overflow
    assert health.verdict(weights_finite=True).why_not == "follows only skipped iterations"
    health.record(skipped=False, loss_finite=True)
    health.record(skipped=True, loss_finite=True)
    assert health.verdict(weights_finite=True).counts  # a step since the last save, the last loss finite
    health.record(skipped=False, loss_finite=True)
    assert health.verdict(weights_finite=False).why_not == "saved non-finite weights"
    health.record(skipped=False, loss_finite=True)
    health.record(skipped=True, loss_finite=False)
    assert health.verdict(weights_finite=True).why_not == "follows a non-finite loss"


def test_resaving_the_pointed_iteration_never_deletes_it_first(tmp_path, monkeypatch):
    """Data loss (5): a re-save of the iteration the pointer names writes a staging directory;
    if it fails, the old one is still there, complete and pointed to."""
    root = tmp_path / "ckpt"
    saved_checkpoint(root)
    before = (layout.iteration_dir(root, 2) / "__0_0.distcp").read_bytes()
    b = make_trainer(f"--checkpoint.save={root}", f"--checkpoint.load={root}", "--checkpoint.load_iteration=2")
    ckpt = checkpointer(b)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(2)
    monkeypatch.undo()
    assert layout.read_pointer(root) == 2 and layout.problem(layout.iteration_dir(root, 2)) is None
    assert (layout.iteration_dir(root, 2) / "__0_0.distcp").read_bytes() == before
    step(b)
    ckpt.save(2)  # this one completes: swapped in, the staging directory gone
    ckpt.finalize()
    assert layout.problem(layout.iteration_dir(root, 2)) is None
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter_0000001", "iter_0000002"]


@pytest.mark.slow
def test_a_kill_while_resaving_the_pointed_iteration_leaves_it_loadable(tmp_path):
    """Atomic saves: a process SIGKILLed while it re-saves the iteration the pointer names (its
    data written, no marker yet) leaves that checkpoint complete, unchanged and pointed to; the
    unfinished save is a staging directory that no load looks at."""
    root = tmp_path / "ckpt"
    saved_checkpoint(root)  # iterations 1 and 2; the pointer names 2
    pointed = layout.iteration_dir(root, 2)
    before = layout.read_marker(pointed)
    resave = [f"--checkpoint.save={root}", f"--checkpoint.load={root}", "--checkpoint.load_iteration=1",
              "--checkpoint.save_interval=1", "--training.train_iters=2", "--faults.kill_at_iteration=2",
              "--faults.kill_during_save=true", "--logging.tensorboard_dir=",
              "--optimizer.override_opt_param_scheduler=true"]  # fmt: skip
    proc = subprocess.run([sys.executable, TRAIN, *SMALL, *resave], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "fault: SIGKILL to rank 0 while saving the checkpoint of iteration 2" in proc.stdout
    assert layout.read_pointer(root) == 2 and layout.read_marker(pointed) == before
    assert layout.problem(pointed) is None and layout.staging_dir(pointed).is_dir()
    b = make_trainer(f"--checkpoint.load={root}")
    checkpointer(b)
    assert b.state.progress.iteration == 2


def test_a_new_save_is_renamed_into_place_only_when_complete(tmp_path, monkeypatch):
    """A save that dies half-way leaves no iter_N at all, only its staging directory; the next
    save of that iteration completes and leaves no staging directory behind."""
    root = tmp_path / "ckpt"
    t = make_trainer(f"--checkpoint.save={root}")
    ckpt = checkpointer(t)
    step(t)

    def half_written(state, checkpoint_id, **kwargs):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", half_written)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(1)
    monkeypatch.undo()
    staging = layout.staging_dir(layout.iteration_dir(root, 1))
    assert layout.list_iterations(root) == [] and staging.is_dir() and layout.read_pointer(root) is None
    ckpt.save(1)
    ckpt.finalize()
    assert layout.list_iterations(root) == [1] and not staging.exists() and layout.read_pointer(root) == 1


def test_a_failed_final_background_save_is_retried_synchronously(tmp_path, monkeypatch):
    """An async save counts as saved only once complete; when the last one fails, the run saves
    that iteration again, synchronously, before it exits, and finalize() has nothing to raise."""
    root = tmp_path / "ckpt"
    t = make_trainer(f"--checkpoint.save={root}", "--checkpoint.async_save=true")
    ckpt = checkpointer(t)
    step(t)

    def failing(*args, **kwargs):
        future = Future()
        future.set_exception(OSError("disk full"))
        return future

    monkeypatch.setattr(dcp, "async_save", failing)
    ckpt.save(1)
    assert not ckpt.saved(1)
    ckpt.save_final(1)
    assert ckpt.saved(1) and layout.read_pointer(root) == 1
    assert layout.problem(layout.iteration_dir(root, 1)) is None
    ckpt.finalize()


@pytest.mark.parametrize("override, message", [
    ("--optimizer.lr=inf", "optimizer.lr=inf must be a finite number"),
    ("--optimizer.adam_beta1=2", "optimizer.adam_beta1=2.0 must be in [0, 1)"),
    ("--optimizer.adam_eps=0", "optimizer.adam_eps=0.0 must be > 0"),
    ("--model.attention_dropout=1", "model.attention_dropout=1.0 must be in [0, 1)"),
    ("--training.seed=99999999999", "training.seed=99999999999 is out of range"),
    ("--model.hidden_size=99999999999999", "model.hidden_size=99999999999999 is out of range"),
    ("--data.split=inf,1,1", "data.split='inf,1,1' must be 1-3 non-negative numbers"),
])  # fmt: skip
def test_out_of_range_settings_are_one_config_error(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [a for a in SMALL if "mock_data" not in a] + ["--data.data_path=corpus", override])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("data_path", ["-1 a 1 b", "nan a 1 b", "0 a 0 b"])
def test_bad_blend_weights_are_one_config_error(data_path):
    from dtgpt.config.blend import parse_blend

    with pytest.raises(ConfigError, match="weights must be finite, >= 0, with a positive sum"):
        parse_blend([data_path])


def test_config_paths_that_are_not_toml_text_are_one_line(tmp_path):
    (tmp_path / "latin1.toml").write_bytes(b"[model]\n# caf\xe9\n")
    (tmp_path / "binary.toml").write_bytes(b"\x00\x01\x02")
    for path, message in ((tmp_path, "cannot be read"), (tmp_path / "latin1.toml", "is not UTF-8 text"),
                          (tmp_path / "binary.toml", "malformed TOML")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_script_outputs_that_cannot_be_written_are_one_line(tmp_path, capfd):
    root = tmp_path / "ckpt"
    saved_checkpoint(root, iterations=(2,))
    convert = load_script("convert_checkpoint")
    (tmp_path / "dir.pt").mkdir()
    assert convert.main(["to-torch", str(root), str(tmp_path / "dir.pt")]) == 2
    assert capfd.readouterr().err.splitlines() == [f"error: {tmp_path / 'dir.pt'}: Is a directory"]
    assert convert.main(["to-torch", str(root), str(tmp_path / "whole.pt")]) == 0
    before = (layout.iteration_dir(root, 2) / layout.MARKER).read_text()
    capfd.readouterr()
    assert convert.main(["from-torch", str(tmp_path / "whole.pt"), str(root)]) == 2  # onto the original
    assert "already holds a checkpoint" in capfd.readouterr().err
    assert (layout.iteration_dir(root, 2) / layout.MARKER).read_text() == before
    assert layout.problem(layout.iteration_dir(root, 2)) is None


@pytest.mark.slow
def test_two_ranks_refuse_a_crafted_checkpoint_and_run_no_code(tmp_path):
    """Under torchrun rank 0 reads the index and every rank gets its verdict: the one line is
    printed once (by one rank), none runs the payload, and nothing is trained or saved."""
    root = tmp_path / "ckpt"
    saved_checkpoint(root, iterations=(2,))
    marker = tmp_path / "PWNED"
    plant_metadata_payload(layout.iteration_dir(root, 2), marker, dotted=False)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", TRAIN, *SMALL,
         f"--checkpoint.save={root}", f"--checkpoint.load={root}"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert all("refusing" in line and "builtins.exec" in line for line in errors)
    assert not marker.exists() and layout.list_iterations(root) == [2]
