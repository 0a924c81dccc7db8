"""Checksums where the bytes are: each rank checksums the files it writes and verifies the byte
ranges it reads; rank 0 only gathers the records into the `complete` marker.

Saving: ChecksummingWriter, DCP's file writer that, once this rank's files are written (in the
writer, so off the training thread for an async save), records the size and CRC-32 of each of
its files and of each item in them (the items tile a file: DCP writes them back to back). The
records travel with DCP's own write results to the coordinator, whose `finish` keeps them
(`records`) and writes DCP's index without them. Rank 0 adds the few files it wrote itself
(`.metadata`, `config.toml`) when it writes the marker (layout.write_marker).

Loading: before DCP reads anything, each rank computes the load plan DCP will follow and checks
every stored item that plan reads against the CRC-32 the marker recorded (read_problem); the
ranks agree on the first problem, and the manager falls back to an older checkpoint as for any
partial one. A marker without item checksums (an older dtgpt's) is checked whole by rank 0, as before.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from dtgpt.checkpoint.layout import CheckpointError

_CHUNK = 1 << 22

Records = dict[str, list]
"""file name -> [size, CRC-32 of the file, [[offset, length, CRC-32], ...] of its items]."""


def crc32_range(path: Path, offset: int, length: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0 and (chunk := f.read(min(_CHUNK, length))):
            crc, length = zlib.crc32(chunk, crc), length - len(chunk)
    return crc


def file_records(directory: Path, ranges: dict[str, set[tuple[int, int]]]) -> Records:
    """The records of the files named in `ranges` (name -> its items' (offset, length)): one
    sequential read of each file gives the file's CRC-32 and each item's."""
    records: Records = {}
    for name, items in sorted(ranges.items()):
        path, whole, pos, crcs = directory / name, 0, 0, []
        with open(path, "rb") as f:
            for offset, length in sorted(items):
                gap = f.read(offset - pos) if offset > pos else b""  # bytes outside any item
                whole = zlib.crc32(gap, whole)
                crc, left = 0, length
                while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                    crc, whole, left = zlib.crc32(chunk, crc), zlib.crc32(chunk, whole), left - len(chunk)
                crcs.append([offset, length, crc])
                pos = offset + length
            while chunk := f.read(_CHUNK):
                whole = zlib.crc32(chunk, whole)
        records[name] = [path.stat().st_size, whole, crcs]
    return records


class _Recorded:
    """A write result's storage data with this rank's records riding along to the coordinator."""

    def __init__(self, storage_data, records: Records | None):
        self.storage_data, self.records = storage_data, records


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that checksums what this rank wrote (see module doc); on the coordinator,
    `records` holds every rank's after the save."""

    def __init__(self, path: str | Path, **kwargs):
        super().__init__(str(path), **kwargs)
        self.records: Records | None = None

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        ranges: dict[str, set[tuple[int, int]]] = {}
        for result in results:
            info = result.storage_data
            ranges.setdefault(info.relative_path, set()).add((info.offset, info.length))
        records = file_records(Path(self.path), ranges)
        carried = [
            WriteResult(r.index, r.size_in_bytes, _Recorded(r.storage_data, records if i == 0 else None)) for i, r in enumerate(results)
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(carried)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records: Records = {}
        plain = []
        for rank_results in results:
            kept = []
            for r in rank_results:
                data = r.storage_data
                if isinstance(data, _Recorded):
                    records.update(data.records or {})
                    data = data.storage_data
                kept.append(WriteResult(r.index, r.size_in_bytes, data))
            plain.append(kept)
        super().finish(metadata, plain)
        self.records = records


class CorruptCheckpoint(CheckpointError):
    """A rank found bytes it was about to load changed since the save: the load falls back."""


def read_problem(directory: Path, request: dict, metadata: Metadata, items: dict) -> str | None:
    """Why the stored items that loading `request` reads on this rank do not match the checksums
    the marker recorded (`items`: file name -> [[offset, length, CRC-32], ...]), or None."""
    request = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in request.items()}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(request, metadata, is_coordinator=False)
    wanted = set()
    for item in planner.create_local_plan().items:
        info = metadata.storage_data[item.storage_index]
        wanted.add((info.relative_path, info.offset, info.length))
    recorded = {name: {offset: (length, crc) for offset, length, crc in entries} for name, entries in items.items()}
    for name, offset, length in sorted(wanted):
        entry = recorded.get(name, {}).get(offset)
        if entry is None or entry[0] != length:
            return f"file {name} holds an item (bytes {offset}-{offset + length}) its marker records no checksum of"
        try:
            crc = crc32_range(directory / name, offset, length)
        except OSError as e:
            return f"unreadable: {e}"
        if crc != entry[1]:
            return f"file {name} does not match the checksum its marker recorded (bytes {offset}-{offset + length} changed since the save)"
    return None
