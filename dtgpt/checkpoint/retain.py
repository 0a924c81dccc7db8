"""Megatron's --save-retain-interval (`checkpoint.save_retain_interval`): after a save completes
and the pointer names it, the checkpoint the pointer named before is deleted unless its iteration
is a multiple of the interval. So the save directory holds the multiples and the newest; a
checkpoint another run left there is never touched (only the one this save replaced as the
newest), nor one behind a symbolic link (Megatron's exception too)."""

from __future__ import annotations

import shutil
from pathlib import Path

from dtgpt.checkpoint import layout


def retire_previous(root: str | Path, previous: int | None, iteration: int, retain_interval: int) -> list[Path]:
    """Delete `previous` (the pointer's iteration before this save) unless it is retained; returns
    what was deleted."""
    if not retain_interval or not previous or previous >= iteration or previous % retain_interval == 0:
        return []
    path = layout.iteration_dir(root, previous)
    if path.is_symlink() or not path.is_dir():
        return []
    shutil.rmtree(path, ignore_errors=True)
    return [path]
