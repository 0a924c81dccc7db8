"""One run per save directory, and only into a directory it may write: an advisory lock that
rank 0 holds for the whole run, the refusal to save over another run's checkpoints, and over
read-only ones.

Two runs saving into one directory would replace each other's checkpoints (and one
directory could mix the files of both). `fcntl.flock` is released by the kernel when the
process dies, so a crashed run never leaves a stale lock behind; the file only names the
holder for the error message of the next run.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from dtgpt.checkpoint.layout import CheckpointError, iteration_dir, list_iterations
from dtgpt.config import Config
from dtgpt.config.batch_schedule import train_iterations

LOCK = ".lock"


class SaveDirLock:
    """Holds `<directory>/.lock` until release() (or until this process ends). A directory the
    run created and left empty is removed on release, so a failed start leaves nothing behind."""

    def __init__(self, directory: str | Path, run_id: str, created: bool = False):
        self.directory, self.created = Path(directory), created
        path = self.directory / LOCK
        self._file = open(path, "a+")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise CheckpointError(
                f"checkpoint.save={directory} is in use by another run ({holder}): two runs saving into one "
                "directory would replace each other's checkpoints; wait for it or choose another directory"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._file.flush()

    def release(self) -> None:
        if self._file.closed:
            return
        if self.created and [p.name for p in self.directory.iterdir()] == [LOCK]:
            (self.directory / LOCK).unlink()  # still locked here: no other run can be waiting on it
            self.directory.rmdir()
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()


def claim_save_dir(directory: str, run_id: str) -> SaveDirLock:
    """Create checkpoint.save (when missing) and lock it for this run (rank 0 calls this)."""
    created = not os.path.exists(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"checkpoint.save={directory} cannot be created: {e.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise CheckpointError(f"checkpoint.save={directory} is not writable")
    return SaveDirLock(directory, run_id, created=created)


def check_save_dir(directory: str, start: int, cfg: Config, loaded_from_it: bool) -> None:
    """Before training (rank 0): refuse a save directory whose checkpoints this run did not load
    from (unless checkpoint.overwrite), or whose iter_* directories it would have to replace but
    cannot (read-only: the save would fail only after training up to it). Nothing is written."""
    if cfg.checkpoint.finetune and loaded_from_it and not cfg.checkpoint.overwrite:
        refuse_finetune_over_its_source(directory)
    if not (loaded_from_it or cfg.checkpoint.overwrite):
        refuse_foreign_checkpoints(directory)
    c, end = cfg.checkpoint, train_iterations(cfg.training, cfg.model.seq_length)  # the run's last save: at train_iters or where exit_interval stops it
    if c.exit_interval:
        end = min(end, (start // c.exit_interval + 1) * c.exit_interval)
    planned = [i for i in list_iterations(directory) if start < i <= end and (i == end or (c.save_interval and i % c.save_interval == 0))]
    stuck = [i for i in planned if not os.access(iteration_dir(directory, i), os.W_OK | os.X_OK)]
    if stuck:
        raise CheckpointError(
            f"checkpoint.save={directory}: {iteration_dir(directory, stuck[0])} is read-only, and this run would replace it "
            f"when it saves iteration {stuck[0]}: make it writable, move it, or save elsewhere (nothing was written)"
        )


def refuse_foreign_checkpoints(directory: str) -> None:
    """For a run that did not load from `directory`: its saves could replace the checkpoints there."""
    found = list_iterations(directory)
    if found:
        raise CheckpointError(
            f"checkpoint.save={directory} already holds checkpoints (iterations {found[0]}..{found[-1]}) that this "
            f"run did not load from: resume with checkpoint.load={directory}, choose another directory, or set "
            "checkpoint.overwrite=true to let this run replace them"
        )


def refuse_finetune_over_its_source(directory: str) -> None:
    """A fine-tune restarts at iteration 0: saving into the directory it loaded its weights from
    would replace that run's iterations (and its pointer) with the fine-tune's."""
    found = list_iterations(directory)
    if found:
        raise CheckpointError(
            f"checkpoint.finetune=true loads the weights of checkpoint.load={directory} and restarts at iteration 0: "
            f"saving into the same directory would replace its checkpoints (iterations {found[0]}..{found[-1]}); "
            "set checkpoint.save to another directory (nothing was written)"
        )
