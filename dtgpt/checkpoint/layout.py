"""The checkpoint directory layout (Megatron's), its pointer, completion markers and pruning.

    <root>/latest_checkpointed_iteration.txt   the iteration to resume from ("100")
    <root>/iter_0000100/.metadata              DCP's index, written last by DCP itself
    <root>/iter_0000100/__0_0.distcp ...       DCP's data, one file per rank
    <root>/iter_0000100/config.toml            the resolved config of the run that saved it
    <root>/iter_0000100/complete               JSON; written only after every rank finished

A directory without a readable `complete` (or without `.metadata`, with an unreadable one, or
whose files do not match the checksums the marker recorded) is partial: it is never pointed to
and a load skips it with a warning. One that would run code when read (dtgpt/checkpoint/safe.py)
is refused outright. Nothing here touches torch.distributed; the caller decides which rank writes.
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
from typing import Callable

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from dtgpt.checkpoint import safe
from dtgpt.checkpoint.saved_config import read_saved_config
from dtgpt.config import Config, ConfigError

POINTER = "latest_checkpointed_iteration.txt"
MARKER = "complete"
CONFIG = "config.toml"
DCP_METADATA = ".metadata"
FORMAT = "dtgpt-dcp-2"
"""2: the train state, LR schedule and loss scale are tensors (1: pickled objects)."""
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_STAGING_DIR = re.compile(r"^iter_(\d{7,})\.saving$")


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


def same_path(a: str, b: str) -> bool:
    """Two non-empty paths naming the same directory."""
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def stored_config(directory: Path) -> Config | None:
    """The config a checkpoint was saved with; None when it has none, or one that no longer reads."""
    try:
        return read_saved_config(Path(directory) / CONFIG, check=False)
    except (ConfigError, OSError):
        return None


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def load_root(root: str, load_iteration: int) -> tuple[str, int, str]:
    """(root, iteration, note): checkpoint.load naming a completed iter_N directory itself means
    its parent at iteration N (the note says so); any other root is taken as it is."""
    path = Path(root)
    match = _ITER_DIR.match(path.name)
    if match is None or not (path / MARKER).exists():
        return root, load_iteration, ""
    iteration = int(match.group(1))
    if load_iteration not in (0, iteration):
        raise CheckpointError(
            f"checkpoint.load={root} is the directory of iteration {iteration}, but checkpoint.load_iteration="
            f"{load_iteration}: name its parent {path.parent} with load_iteration, or the directory alone"
        )
    return str(path.parent), iteration, f"checkpoint.load={root} is an iteration directory: loading iteration {iteration} of {path.parent}"


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a half-written one (temp + fsync + rename)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a crash after it cannot undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


STAGING = ".saving"


def staging_dir(directory: Path) -> Path:
    """Where the save of iteration directory `directory` writes (not an iter_* name: never loaded)."""
    return directory.with_name(directory.name + STAGING)


def swap_in(directory: Path, final: Path) -> None:
    """Make the complete `directory` the iteration directory `final`, durably (the parent is
    fsynced). An old `final` is moved aside before and deleted after, so at every moment one
    complete copy exists; a crash in between leaves the pointer naming a missing directory, and
    a load falls back to the newest complete one."""
    if final.exists() and not os.access(final, os.W_OK | os.X_OK):  # its files could not be removed after the swap
        raise CheckpointError(f"{final} is read-only, so a new save cannot replace it; {POINTER} not moved")
    old = final.with_name(final.name + ".replaced")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(directory, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def read_pointer(root: str | Path) -> int | None:
    """The iteration named by the pointer file, or None when it is missing or unreadable."""
    try:
        text = (Path(root) / POINTER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isascii() and text.isdigit() else None


def pointer_state(root: str | Path) -> str:
    """What root's pointer says, for a message: the iteration it names, or why it names none."""
    pointer, pointed = Path(root) / POINTER, read_pointer(root)
    if pointed is not None or not pointer.exists():
        return f"{POINTER} names iteration {pointed}" if pointed is not None else f"no {POINTER}"
    try:
        return f"{POINTER} holds {pointer.read_text().strip()[:40]!r}, not an iteration number"
    except (OSError, UnicodeDecodeError) as e:
        return f"{POINTER} cannot be read ({e})"


def write_pointer(root: str | Path, iteration: int) -> None:
    pointer = Path(root) / POINTER
    if pointer.is_dir():  # os.replace cannot put a file there: say what is in the way
        raise CheckpointError(f"{pointer} is a directory, so the pointer to iteration {iteration} cannot be written; remove it")
    write_atomic(pointer, f"{iteration}\n")
    fsync_dir(Path(root))  # the rename itself survives a crash


def write_marker(directory: Path, info: dict, records: dict | None = None) -> None:
    """Mark `directory` complete, recording the CRC-32 of each of its files (checked on load)."""
    info = {**info, **safe.marker_checksums(directory, (MARKER,), records)}
    write_atomic(directory / MARKER, json.dumps(info, indent=1, sort_keys=True) + "\n")
    fsync_dir(directory)


def read_marker(directory: Path) -> dict:
    """The completion marker; CheckpointError when it is not a JSON object."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{directory / MARKER} is unreadable: {e}") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{directory / MARKER} is not a JSON object")
    return marker


def read_metadata(directory: str | Path, trust_pickles: bool = False, unread: Callable[[str], bool] | None = None) -> Metadata:
    """DCP's index of `directory`, unpickled with the allowlist of safe.py unless trusted.
    CheckpointError when it names a class outside the allowlist or holds a pickled item, except
    items `unread` accepts: the caller never reads those (and safe.SafeReader would refuse to)."""
    directory = Path(directory)
    if trust_pickles:
        return FileSystemReader(str(directory)).read_metadata()
    try:
        metadata = safe.load_metadata(directory / DCP_METADATA)
    except safe.UnsafeCheckpointError as e:
        raise CheckpointError(f"refusing {directory / DCP_METADATA}: {e} (see checkpoint.trust_pickles)") from None
    objects = [key for key in safe.pickled_items(metadata) if not (unread and unread(key))]
    if objects:
        raise CheckpointError(
            f"refusing {directory}: item {objects[0]} is a pickled object, which could run code when loaded "
            "(dtgpt saves tensors only; see checkpoint.trust_pickles)"
        )
    return metadata


def problem(directory: Path, deep: bool = True, trust_pickles: bool = False, data: bool = True) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when it is one.

    `deep` also reads the marker and the DCP index, and checks every file against the checksum
    the marker recorded (or, for a marker without checksums, every data file is as long as the
    index says); not `data`: files whose items it checksums are only measured (integrity.py).
    A checkpoint that would run code when read raises CheckpointError instead.
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
        marker = read_marker(directory)
        if "checksums" in marker:
            sized = () if data else tuple(marker.get("item_checksums") or ())
            return safe.checksum_problem(directory, marker["checksums"], sized) or _index_problem(directory, trust_pickles, False)
        return _index_problem(directory, trust_pickles, True)
    except OSError as e:
        return f"unreadable: {e}"
    except CheckpointError as e:
        if str(e).startswith("refusing"):
            raise  # not partial: it would run code when read
        return str(e)


def _index_problem(directory: Path, trust_pickles: bool, sizes: bool) -> str | None:
    """Why DCP's index of `directory` is unusable: unreadable, or (`sizes`, for a marker without
    checksums) naming data files shorter than it says."""
    try:
        metadata = read_metadata(directory, trust_pickles)
        return short_data_file(directory, metadata) if sizes else None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable index means the same thing here
        return f"unreadable {DCP_METADATA}: {type(e).__name__}: {e}"


def short_data_file(directory: Path, metadata: Metadata) -> str | None:
    """The first data file of `directory` that is missing or shorter than DCP's index says (the
    index records where each item lives: a shorter file was truncated), or None."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
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
    root: str, load_iteration: int, fresh_ok: bool, fix: str = "fix the path, or set checkpoint.auto_resume=true to start from scratch",
    trust_pickles: bool = False, data: bool = True, bad: dict[int, str] | None = None,
) -> Resolved:
    """Pick the checkpoint to load from `root`.

    load_iteration > 0 names one directory, which must be complete. Otherwise the pointer is
    followed; when it is missing or names a partial directory, the newest complete one is used
    instead, with a warning (`data`, `bad`: see problem() and why_not). With no checkpoint at all: start fresh when `fresh_ok` (root is
    also the save directory, or auto_resume), else raise. When a directory that was once
    completed (it has a marker) no longer loads, always raise: starting fresh would let the new
    run's saves replace it. Directories of saves that never finished do not count.
    """
    def why_not(iteration: int) -> str | None:  # `bad`: found by the ranks' reads (integrity.read_problem)
        return (bad or {}).get(iteration) or problem(iteration_dir(root, iteration), trust_pickles=trust_pickles, data=data)

    warnings: list[str] = []
    if load_iteration > 0:
        directory = iteration_dir(root, load_iteration)
        why = why_not(load_iteration)
        if why is not None:
            complete = [i for i in list_iterations(root) if why_not(i) is None]
            raise CheckpointError(
                f"checkpoint.load_iteration={load_iteration}: {directory} is not a complete checkpoint ({why}); "
                f"complete iterations in {root}: {complete or 'none'}"
            )
        return Resolved(directory, load_iteration, warnings)
    pointed = read_pointer(root)
    candidates = list_iterations(root)
    if pointed is not None:
        why = why_not(pointed)
        if why is None:
            return Resolved(iteration_dir(root, pointed), pointed, warnings)
        pointer = f"{pointer_state(root)}, but {iteration_dir(root, pointed).name} is not usable ({why})"
        warnings.append(f"{root}/{pointer}")
    newest_why = None
    for iteration in reversed(candidates):
        why = why_not(iteration)
        newest_why = newest_why or f"{iteration_dir(root, iteration).name}: {why}"
        if why is None:
            if pointed is None:
                warnings.append(f"{root} has no readable {POINTER}; using the newest complete checkpoint")
            warnings.append(f"falling back to {iteration_dir(root, iteration)}")
            return Resolved(iteration_dir(root, iteration), iteration, warnings)
        warnings.append(f"skipping partial checkpoint {iteration_dir(root, iteration)}: {why}")
    sealed = [i for i in candidates if (iteration_dir(root, i) / MARKER).exists()]
    if sealed:
        raise CheckpointError(
            f"checkpoint.load={root}: none of its completed checkpoints (iterations {sealed}) loads now "
            f"(newest {newest_why}); refusing to start from scratch over them: "
            "fix or move them, or point checkpoint.save and checkpoint.load elsewhere"
        )
    pointer = pointer_state(root) if pointed is None else pointer
    note = f"checkpoint.load={root} holds no complete checkpoint ({pointer}; no completed iter_* directory)"
    if not fresh_ok:
        raise CheckpointError(note + "; " + fix)
    return Resolved(None, 0, warnings, note)


def counts_for_keep_last(directory: Path) -> bool:
    """Whether a complete checkpoint counts toward keep_last: its marker says so (a save after
    the run went bad does not: dtgpt.state.RunHealth); older markers say whether the weights were finite."""
    marker = read_marker(directory)
    return bool(marker.get("counts_for_keep_last", marker.get("weights_finite", True)))


def prune(root: str | Path, keep_last: int, pointed: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints that count (counts_for_keep_last)
    up to `pointed`, and the other directories older than it. Never the pointed one, never
    anything newer (an older run's, or a save still in flight). Returns what was deleted."""
    if keep_last <= 0:
        return []
    older = [i for i in list_iterations(root) if i <= pointed]
    complete = [i for i in older if problem(iteration_dir(root, i), deep=False) is None]
    counted = [i for i in complete if counts_for_keep_last(iteration_dir(root, i))]
    keep = set(counted[-keep_last:]) | {pointed}
    deleted = []
    for iteration in older:
        if iteration not in keep:
            path = iteration_dir(root, iteration)
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted


def remove_stale_staging(root: str | Path, pointed: int) -> None:
    """Delete the staging directories of saves that died, up to the pointed iteration (a newer
    one may be a save in flight)."""
    for path in Path(root).iterdir():
        match = _STAGING_DIR.match(path.name)
        if match and int(match.group(1)) <= pointed:
            shutil.rmtree(path, ignore_errors=True)


def describe(error: BaseException) -> str:
    """A one-line reason: DCP wraps each failing rank's exception in a CheckpointException."""
    failures = getattr(error, "failures", None)
    if not failures:
        return _one_reason(error)
    parts = []
    for rank, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank}: {_one_reason(exc)}")
    return "; ".join(parts)


def _one_reason(error: BaseException) -> str:
    """`Type: message`; torch's file writer reports a full disk as a position mismatch, so that
    one is named for what it usually is."""
    text = f"{type(error).__name__}: {error}"
    if "unexpected pos" in str(error):
        text += " (the file came out shorter than written: usually no space left on the device)"
    return text
