"""The checkpoint writer of fault injection (dtgpt.faults.injection.FaultHooks.storage_writer)."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Callable

from dtgpt.checkpoint.integrity import ChecksummingWriter
from dtgpt.faults.injection import _announce, _kill


class FaultyWriter(ChecksummingWriter):
    """dtgpt's checkpoint writer, then a fault once this rank's data files are written (so the
    directory is as a real failure leaves it: data without `.metadata` or the `complete` marker).
    It checksums as every rank's writer does, so whichever rank coordinates takes every rank's
    records off the results before DCP writes `.metadata`."""

    def __init__(self, path: Path, action: str, rank: int, iteration: int, failed: Callable[[], None] = lambda: None):
        super().__init__(str(path))
        self.action, self.fault_rank, self.iteration = action, rank, iteration
        self.failed = failed  # called when the write fails before the fault acts (the rank then lives on)

    def write_data(self, plan, planner):
        where = f"while saving the checkpoint of iteration {self.iteration}"
        if self.action == "signal":
            # A second (and third) signal during the save: the handler must ignore them.
            for sig in (signal.SIGTERM, signal.SIGINT):
                _announce(f"{sig.name} to rank {self.fault_rank} {where}")
                os.kill(os.getpid(), sig)
        try:
            future = super().write_data(plan, planner)
            future.wait()
        except BaseException:
            self.failed()
            raise
        if self.action == "kill":
            _kill(self.fault_rank, where)
        if self.action == "disk_full":
            # The disk filled up half-way through this rank's files.
            for path in Path(self.path).glob(f"{plan.storage_data.prefix}*"):
                os.truncate(path, path.stat().st_size // 2)
            _announce(f"ENOSPC on rank {self.fault_rank} {where}")
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by faults.disk_full_at_iteration)")
        return future
