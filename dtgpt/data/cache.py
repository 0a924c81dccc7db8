"""On-disk cache for built data (index arrays, the built-in corpus): where it lives, how it is keyed,
and the one place that makes rank 0 build it while the other ranks wait."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from dtgpt.data.indexed import DataError

DEFAULT_CACHE_ROOT = "~/.cache/dtgpt"


def cache_root(data_cache_path: str) -> str:
    """`data.data_cache_path`, or ~/.cache/dtgpt when it is unset."""
    return os.path.expanduser(data_cache_path or DEFAULT_CACHE_ROOT)


def index_cache_dir(data_cache_path: str, prefix: str) -> str:
    """Where a dataset's index arrays go: data_cache_path if set, else next to the data
    (Megatron's `<data dir>/cache/GPTDataset_indices`), else ~/.cache/dtgpt when that is read-only."""
    if data_cache_path:
        return os.path.join(os.path.expanduser(data_cache_path), "GPTDataset_indices")
    beside = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")
    if _writable(beside):
        return beside
    return os.path.join(os.path.expanduser(DEFAULT_CACHE_ROOT), "GPTDataset_indices")


def _writable(path: str) -> bool:
    p = Path(path)
    while not p.exists():
        p = p.parent
    return os.access(p, os.W_OK)


CACHE_FORMAT = 2
"""Part of every cache key. 2: each array has a `.crc32` beside it. Caches of an older format
are then simply not found (and rebuilt quietly), instead of failing their checksum check."""


def description_hash(description: dict) -> str:
    """A stable key for everything a cached artefact depends on (and the cache format)."""
    text = f"v{CACHE_FORMAT}:" + json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def file_fingerprint(path: str) -> dict:
    """Identity of an input file for cache keys: path, size and modification time.

    A copied or touched file makes a new key; rebuilding is deterministic, so that only costs time.
    """
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def save_npy(path: str, array: np.ndarray) -> None:
    """np.save under a temporary name, then rename: readers never see a partial file. A
    `<path>.crc32` beside it records the checksum that is_cached() checks."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array)
    # The checksum goes in place first: an array that exists always has its checksum, so a
    # reader never takes a build in progress for a damaged cache.
    Path(f"{path}.crc32.tmp-{os.getpid()}").write_text(f"{_crc32(tmp)}\n")
    os.replace(f"{path}.crc32.tmp-{os.getpid()}", f"{path}.crc32")
    os.replace(tmp, path)


def is_cached(paths) -> bool:
    """Whether every cached array exists and matches the checksum written with it. A file that
    was changed since (or has no checksum) is reported in one line and removed, to be rebuilt."""
    for path in paths:
        if not os.path.isfile(path):
            return False
        try:
            ok = Path(f"{path}.crc32").read_text().strip() == str(_crc32(path))
        except (OSError, UnicodeDecodeError):
            ok = False
        if not ok:
            print(f"WARNING: data index cache {path} does not match its checksum: rebuilding it", flush=True)
            Path(path).unlink(missing_ok=True)
            return False
    return True


def load_npy(path: str) -> np.ndarray:
    """A cached index array, read as data (never unpickled). The checksum proves only that the file
    is the one written beside it: anything but an array of integers is refused in one line."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # an object array, a damaged header, no .npy at all
        array, why = None, str(e).rstrip(".")
    else:
        why = f"its dtype is {array.dtype}"
    if array is None or array.dtype.kind not in "iu":
        raise DataError(f"data index cache {path} is not an index array this cache writes ({why}): "
                        "remove it (and its .crc32) to rebuild it")  # fmt: skip
    return array


def _process_group():
    """torch.distributed when a process group is up, else None. No process group can exist unless
    torch.distributed was imported; looking it up instead of importing it keeps torch out of
    preprocessing and corpus building."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def is_global_rank_zero() -> bool:
    """Whether this process is global rank 0 (or there is no process group)."""
    dist = _process_group()
    return dist is None or dist.get_rank() == 0


def build_once(is_built: Callable[[], bool], build: Callable[[], None]) -> None:
    """Run `build` on global rank 0 while the other ranks wait, unless `is_built()` already.

    A rank that still finds nothing after the barrier (a node-local cache directory, or rank 0
    failed) builds for itself: builds are deterministic and write atomically, so that is safe.
    """
    dist = _process_group()
    error = None
    if is_global_rank_zero() and not is_built():
        try:
            build()
        except Exception as e:  # other ranks must still reach the barrier below
            error = e
    if dist is not None:
        dist.barrier()
    if error is not None:
        raise error
    if not is_built():
        build()
