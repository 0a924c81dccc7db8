"""Reading a checkpoint as data, never as code, and checking that its files are the ones written.

DCP stores its index (`.metadata`) as a pickle, and any non-tensor item of a `.distcp` file too
(read back with `torch.load(weights_only=False)`). Unpickling runs whatever the file names, so a
downloaded or tampered checkpoint could run code on load. Here:

- `.metadata` is unpickled with an allowlist: DCP's metadata dataclasses, `torch.Size`, dtypes,
  memory formats and plain containers. Anything else is refused, naming the file and the class.
- dtgpt saves no non-tensor item (train-state counters are tensors, dtgpt.state), so a
  checkpoint holding one (a pickled object) is refused before any byte of it is read.
- the completion marker records a CRC-32 of every file of the directory and of each item in a
  data file (dtgpt/checkpoint/integrity.py: each rank checksums what it writes and verifies what
  it reads), so overwritten bytes make the checkpoint partial.

`checkpoint.trust_pickles=true` lifts the first two for a checkpoint one trusts (an older
dtgpt's, or another tool's), with a warning.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    )
} | {
    # the save plan Megatron's torch_dist checkpoints keep in their metadata: plain dataclasses
    ("torch.distributed.checkpoint.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
} | {("builtins", name) for name in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool")}
"""Exact (module, name) pairs: a module prefix would not do, pickle resolves dotted names
("torch.distributed.checkpoint.filesystem", "os.system") through the module's imports."""
_CHUNK = 1 << 22


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint names a class outside the allowlist (it could run code when loaded)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED or (
            module == "torch" and "." not in name and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
        )
        if not allowed:
            raise UnsafeCheckpointError(f"it names {module}.{name}, which is not DCP metadata")
        return super().find_class(module, name)


def load_metadata(path: Path) -> Metadata:
    """Unpickle a DCP `.metadata` file with the allowlist; any other class raises UnsafeCheckpointError."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def pickled_items(metadata: Metadata) -> list[str]:
    """The keys DCP would unpickle with torch.load(weights_only=False) (non-tensor items)."""
    return sorted(k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata))


class SafeReader(FileSystemReader):
    """DCP's file reader with the allowlisted `.metadata` and no non-tensor item (unless trusted)."""

    def __init__(self, path: str | Path, trust_pickles: bool = False):
        super().__init__(str(path))
        self.trust_pickles = trust_pickles

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.trust_pickles:
            return super().read_metadata(*args, **kwargs)
        metadata = load_metadata(Path(self.path) / ".metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as DCP's own reader does
        return metadata

    def read_data(self, plan, planner):
        if not self.trust_pickles:
            objects = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
            if objects:
                raise UnsafeCheckpointError(f"{self.path}: item {objects[0].dest_index.fqn} is a pickled object")
        return super().read_data(plan, planner)


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def checksums(directory: Path, skip: tuple[str, ...]) -> dict[str, list[int]]:
    """[size, CRC-32] of every plain file in `directory` but `skip` (the marker itself)."""
    return {p.name: [p.stat().st_size, crc32(p)] for p in sorted(directory.iterdir()) if p.is_file() and p.name not in skip}


def marker_checksums(directory: Path, skip: tuple[str, ...], records: dict | None) -> dict:
    """The marker's checksum fields: [size, CRC-32] of every file but `skip`, those the ranks
    `records`ed (dtgpt/checkpoint/integrity.py) taken from them, the rest read here; with
    records, also each item's (offset, length, CRC-32), by file."""
    records = records or {}
    sums = checksums(directory, skip=(*skip, *records)) | {name: r[:2] for name, r in records.items()}
    items = {"item_checksums": {name: r[2] for name, r in records.items()}} if records else {}
    return {"checksums": dict(sorted(sums.items())), **items}


def checksum_problem(directory: Path, recorded: dict, sized: tuple[str, ...] = ()) -> str | None:
    """Why the files of `directory` are not the ones the marker recorded, or None; the files
    `sized` are only measured (their bytes are verified as they are read)."""
    if not isinstance(recorded, dict):
        return "its marker records no checksums"
    for name, entry in sorted(recorded.items()):
        path = directory / name
        if not path.is_file():
            return f"file {name} is missing"
        if not (isinstance(entry, list) and len(entry) == 2):
            return f"its marker records no valid checksum of {name}"
        size, crc = entry
        if path.stat().st_size != size:
            return f"file {name} is truncated or extended ({path.stat().st_size} bytes, {size} were written)"
        if name not in sized and crc32(path) != crc:
            return f"file {name} does not match the checksum its marker recorded (changed since the save)"
    return None


def trust_warning(directory: Path) -> str:
    return f"checkpoint.trust_pickles=true: {directory} is unpickled without an allowlist; load only checkpoints you trust"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def unpickling_reason(error: BaseException) -> str:
    """One plain line of why torch.load refused a file: its weights-only unpickler explains over
    several lines with terminal colour codes, of which the line naming the refused global says it."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    named = next((line for line in lines if "global" in line.lower()), None)
    if named is not None:
        return named.split("WeightsUnpickler error:")[-1].strip()
    marker = "WeightsUnpickler error:"
    for i, line in enumerate(lines):
        if marker in line:  # the reason follows the marker, on its line or the next
            rest = line.split(marker, 1)[1].strip()
            return rest or (lines[i + 1] if i + 1 < len(lines) else line)
    return lines[0] if lines else type(error).__name__


def load_problem(path: Path, error: BaseException) -> str:
    """Why torch.load failed on `path`, in one line: a torch.save archive cut short or damaged is
    named as such (torch's own words for it are about zip internals or a bare errno), anything
    else as the unpickler refused it."""
    return archive_damage(Path(path)) or unpickling_reason(error)


def archive_damage(path: Path) -> str | None:
    """Why the zip archive torch.save writes is incomplete or damaged; None when it is whole, or
    when the file is no zip archive at all (random bytes, a bare pickle: another problem)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        size = path.stat().st_size
    except OSError:  # unreadable: torch's error says it
        return None
    if size == 0:
        return "it is empty (0 bytes): the copy is incomplete"
    if head != b"PK\x03\x04":
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record against its CRC-32
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        return f"it is truncated or corrupt ({size} bytes, not a complete torch.save archive: {e})"
    return f"it is corrupt (its record {bad} does not match its CRC-32)" if bad else None
