"""The checkpoint directory layout (Megatron's), its pointer, completion markers and pruning.

    <root>/latest_checkpointed_iteration.txt   the iteration to resume from ("100")
    <root>/iter_0000100/.metadata              DCP's index, written last by DCP itself
    <root>/iter_0000100/__0_0.distcp ...       DCP's data, one file per rank
    <root>/iter_0000100/config.toml            the resolved config of the run that saved it
    <root>/iter_0000100/complete               JSON; written only after every rank finished

A directory without `complete` (or without `.metadata`, or whose data files are shorter than
the metadata says) is partial: it is never pointed to and a load skips it with a warning.
Nothing here touches torch.distributed; the caller decides which rank writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

POINTER = "latest_checkpointed_iteration.txt"
MARKER = "complete"
CONFIG = "config.toml"
DCP_METADATA = ".metadata"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which one and why."""


NO_PROCESS_GROUP = "torch.distributed is disabled, unavailable or uninitialized"
"""DCP's warning on every call without a process group; a one-process run means exactly that."""
# The background thread of an async save warns too, after any `with` block around the call has
# exited: that one message is ignored for the whole process.
warnings.filterwarnings("ignore", message=NO_PROCESS_GROUP)


@contextlib.contextmanager
def single_process():
    """DCP calls of a one-process run (see NO_PROCESS_GROUP)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_PROCESS_GROUP)
        yield


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a half-written one (temp + fsync + rename)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_pointer(root: str | Path) -> int | None:
    """The iteration named by the pointer file, or None when it is missing or unreadable."""
    try:
        text = (Path(root) / POINTER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def write_pointer(root: str | Path, iteration: int) -> None:
    write_atomic(Path(root) / POINTER, f"{iteration}\n")


def write_marker(directory: Path, info: dict) -> None:
    write_atomic(directory / MARKER, json.dumps(info, indent=1, sort_keys=True) + "\n")


def read_marker(directory: Path) -> dict:
    return json.loads((directory / MARKER).read_text())


def read_metadata(directory: str | Path) -> Metadata:
    return FileSystemReader(str(directory)).read_metadata()


def problem(directory: Path, deep: bool = True) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when it is one.

    `deep` also reads the DCP index and checks every data file is as long as it says.
    """
    if not directory.is_dir():
        return "no such directory"
    if not (directory / DCP_METADATA).is_file():
        return f"no {DCP_METADATA} (the save did not finish)"
    if not (directory / MARKER).is_file():
        return f"no '{MARKER}' marker (the save did not finish on every rank)"
    if not deep:
        return None
    try:
        metadata = read_metadata(directory)
    except Exception as e:  # noqa: BLE001 - any unreadable index means the same thing here
        return f"unreadable {DCP_METADATA}: {e}"
    # The index records where each item lives; a data file shorter than that was truncated.
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            return f"data file {name} is missing"
        if path.stat().st_size < size:
            return f"data file {name} is truncated ({path.stat().st_size} bytes, the index needs {size})"
    return None


def list_iterations(root: str | Path) -> list[int]:
    """Every iter_* directory under root, complete or not, in increasing order."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _ITER_DIR.match(path.name)
        if match and path.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


@dataclass
class Resolved:
    """What a load should read: a complete iteration directory, or nothing (start fresh)."""

    directory: Path | None
    iteration: int
    warnings: list[str]
    note: str = ""
    """Why nothing is loaded, when directory is None."""


def resolve(
    root: str, load_iteration: int, fresh_ok: bool, fix: str = "fix the path, or set checkpoint.auto_resume=true to start from scratch"
) -> Resolved:
    """Pick the checkpoint to load from `root`.

    load_iteration > 0 names one directory, which must be complete. Otherwise the pointer is
    followed; when it is missing or names a partial directory, the newest complete one is used
    instead, with a warning. With no complete checkpoint at all: start fresh when `fresh_ok`
    (root is also the save directory, or auto_resume), else raise.
    """
    warnings: list[str] = []
    if load_iteration > 0:
        directory = iteration_dir(root, load_iteration)
        why = problem(directory)
        if why is not None:
            complete = [i for i in list_iterations(root) if problem(iteration_dir(root, i)) is None]
            raise CheckpointError(
                f"checkpoint.load_iteration={load_iteration}: {directory} is not a complete checkpoint ({why}); "
                f"complete iterations in {root}: {complete or 'none'}"
            )
        return Resolved(directory, load_iteration, warnings)
    pointed = read_pointer(root)
    candidates = list_iterations(root)
    if pointed is not None:
        why = problem(iteration_dir(root, pointed))
        if why is None:
            return Resolved(iteration_dir(root, pointed), pointed, warnings)
        warnings.append(f"{root}/{POINTER} names iteration {pointed}, but {iteration_dir(root, pointed)} is not usable ({why})")
    for iteration in reversed(candidates):
        why = problem(iteration_dir(root, iteration))
        if why is None:
            if pointed is None:
                warnings.append(f"{root} has no readable {POINTER}; using the newest complete checkpoint")
            warnings.append(f"falling back to {iteration_dir(root, iteration)}")
            return Resolved(iteration_dir(root, iteration), iteration, warnings)
        warnings.append(f"skipping partial checkpoint {iteration_dir(root, iteration)}: {why}")
    note = f"checkpoint.load={root} holds no complete checkpoint (no {POINTER} naming one, no complete iter_* directory)"
    if not fresh_ok:
        raise CheckpointError(note + "; " + fix)
    return Resolved(None, 0, warnings, note)


def prune(root: str | Path, keep_last: int, pointed: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints up to `pointed`, and partial
    directories older than it. Never the pointed one, never anything newer (an older run's,
    or a save still in flight). Returns what was deleted."""
    if keep_last <= 0:
        return []
    older = [i for i in list_iterations(root) if i <= pointed]
    complete = [i for i in older if problem(iteration_dir(root, i), deep=False) is None]
    keep = set(complete[-keep_last:]) | {pointed}
    deleted = []
    for iteration in older:
        if iteration not in keep:
            path = iteration_dir(root, iteration)
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted
