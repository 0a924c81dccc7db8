"""The checkpointer's part in an in-process recovery (dtgpt/faults/recovery.py), and the group
that both it and start-up open for background saves.

The survivors keep their Checkpointer: they wait for a save in flight before the old groups go
(a dead rank fails it; the pointer never moved to it, so its failure is not the run's), and
`rejoin()` opens the background saves' group on the new world. The replacement builds a
`joining` Checkpointer: its state came from its replica twin, so it loads nothing and runs none
of start-up's collective checks (the survivors ran them); it opens the same group, in the same
place of the order of collectives; and as rank 0 it takes the save directory's lock, which the
kernel released when its predecessor died.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from dtgpt.checkpoint.lock import claim_save_dir


class Rejoining:
    """Mixed into dtgpt.checkpoint.Checkpointer (its attributes: cfg, run_cfg, runtime, distributed, ...)."""

    def _background_group(self) -> dist.ProcessGroup | None:
        """A background save's collectives run on a gloo group of their own (never interleaved with
        training's), with the run's timeout, not 30 minutes: a dead peer fails it, not hangs it."""
        if not (self.cfg.async_save and self.cfg.save and self.distributed):
            return None
        return dist.new_group(backend="gloo", timeout=timedelta(minutes=self.run_cfg.distributed.timeout_minutes))

    def _join(self) -> None:
        if self.cfg.save and self.runtime.is_main:
            self._lock = claim_save_dir(self.cfg.save, self.run_id)

    def rejoin(self) -> None:
        """A survivor, once the new world is up (it called wait() before the old one went)."""
        for iteration in sorted(self._failures):
            self._log(f"the background save of iteration {iteration} was lost with the dead rank; the next save replaces it")
        self._failures.clear()
        self._async_group = self._background_group()
