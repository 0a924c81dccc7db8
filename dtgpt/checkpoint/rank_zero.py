"""The checkpointer's two collective patterns: rank 0 decides and tells every rank, or every
rank checks and all raise the same error when any found a problem."""

from __future__ import annotations

import torch.distributed as dist

from dtgpt.checkpoint.layout import CheckpointError


class RankZeroCalls:
    """Mixed into dtgpt.checkpoint.Checkpointer (its attributes: runtime, distributed)."""

    def _from_rank0(self, fn):
        """Run fn on rank 0 only and give every rank its result (or its CheckpointError)."""
        result = None
        if self.runtime.is_main:
            try:
                result = ("ok", fn())
            except CheckpointError as e:
                result = ("error", str(e))
        if self.distributed:
            box = [result]
            dist.broadcast_object_list(box, src=0)
            result = box[0]
        if result[0] == "error":
            raise CheckpointError(result[1])
        return result[1]

    def _agree(self, message: str | None, error: type[CheckpointError] = CheckpointError) -> None:
        """Raise the same `error` on every rank if any rank found a problem."""
        messages = [message]
        if self.distributed:
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, message)
        first = next((m for m in messages if m), None)
        if first:
            raise error(first)
