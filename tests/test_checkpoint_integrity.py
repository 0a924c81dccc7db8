"""Checksums where the bytes are (dtgpt/checkpoint/integrity.py), in one process: the writer
checksums its own files and items (in the background thread of an async save), the marker
records them, and a load checks each item it reads, naming the bytes that changed."""

from __future__ import annotations

import threading

from dtgpt.checkpoint import integrity, layout
from tests.test_checkpoint_safety import saved_checkpoint
from tests.checkpoints import checkpointer, make_trainer, step


def test_the_writer_checksums_off_the_training_thread_and_the_marker_keeps_every_item(tmp_path, monkeypatch):
    threads, records = [], integrity.file_records
    monkeypatch.setattr(integrity, "file_records", lambda *a: threads.append(threading.current_thread()) or records(*a))
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.async_save=true")
    step(t)
    ckpt = checkpointer(t)
    ckpt.save(1)
    ckpt.finalize()
    assert threads and threading.main_thread() not in threads
    directory = layout.iteration_dir(tmp_path, 1)
    marker = layout.read_marker(directory)
    metadata = layout.read_metadata(directory)
    stored = {(i.relative_path, i.offset, i.length) for i in metadata.storage_data.values()}
    recorded = {(name, offset, length) for name, items in marker["item_checksums"].items() for offset, length, _ in items}
    assert stored == recorded
    for name, (size, crc, _) in records(directory, {n: set() for n in marker["item_checksums"]}).items():
        assert marker["checksums"][name] == [size, crc]  # the whole file's, from the same pass


def test_a_changed_item_is_named_by_its_bytes_and_the_older_checkpoint_loads(tmp_path, capsys):
    saved_checkpoint(tmp_path)
    data = layout.iteration_dir(tmp_path, 2) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    b = make_trainer(f"--checkpoint.load={tmp_path}", "--model.hidden_dropout=0.0")
    checkpointer(b)
    assert b.state.progress.iteration == 1
    out = capsys.readouterr().out
    assert "file __0_0.distcp does not match the checksum its marker recorded (bytes " in out
    assert "falling back to" in out
