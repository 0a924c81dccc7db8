"""Pipeline receive buffers that live only while their micro-batch is in flight.

torch's PipelineStage allocates, when a schedule first runs, one activation receive buffer and
one gradient receive buffer for every micro-batch of the iteration, and keeps them (and each
activation buffer's input gradient) for the stage's life: memory that grows with the micro-batch
count (1,536 boundary activations per stage in configs/gpt3_175b.toml), where Megatron holds
receive tensors only for the micro-batches in flight.

`BoundedPipelineStage` is torch's PipelineStage with the buffers made per use: a micro-batch's
receive buffer is created when its receive is posted (or when a same-rank stage hands its tensor
over) and the stage lets go of it once the forward (or backward) that reads it has run. What
autograd still needs (a received activation is the leaf of that micro-batch's graph until its
backward) it keeps by its own references, so the schedule's order, its tensors and its numerics
are torch's; only the stage's own references are dropped.

This leans on torch's private stage internals (`args_recv_info`, `grad_recv_info`, `_RecvInfo
.buffer`, `_setup_forward_recv_info`, `_create_grad_recv_info`, `_make_tensor_from_meta`,
`fwd_cache`). torch 2.13 describes each receive apart from its buffer (`_RecvInfo.tensor_meta`) and
sets up every micro-batch's receive in `_setup_forward_recv_info`; torch 2.11 describes a receive
only by its buffer and allocates every micro-batch's in `_prepare_forward_infra`, so on 2.11 a
dropped buffer leaves a meta tensor in its place. It was checked on the torch versions in CHECKED_TORCH; on another torch whose
internals differ the stage keeps torch's own buffers (`supported()` says which), and
tests/test_pipeline_buffers.py fails on the pinned torch if they change.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import stage as torch_stage

CHECKED_TORCH = ("2.11", "2.13")

DESCRIBES_RECEIVES = hasattr(PipelineStage, "_setup_forward_recv_info")
"""torch 2.13's stage (each receive's tensor_meta, a set-up per micro-batch); False on torch 2.11."""

_PRIVATE = ("_setup_forward_recv_info" if DESCRIBES_RECEIVES else "_prepare_forward_infra", "_create_grad_recv_info", "set_local_fwd_input", "set_local_bwd_input",
            "get_fwd_recv_ops", "get_bwd_recv_ops", "forward_one_chunk", "backward_one_chunk", "get_fwd_send_ops")  # fmt: skip


def supported() -> bool:
    """Whether this torch's PipelineStage has the internals this module replaces."""
    return all(hasattr(PipelineStage, name) for name in _PRIVATE) and hasattr(torch_stage, "_make_tensor_from_meta")


def _without_buffers(infos: tuple) -> tuple:
    """Copies of a micro-batch's receive infos that hold no buffer (root arguments unchanged)."""
    out = []
    for info in infos:
        buffer = getattr(info, "buffer", None)  # torch 2.11's root arguments are placeholders without one
        if buffer is not None and not getattr(info, "is_root_arg", False):
            info = copy.copy(info)
            if not hasattr(info, "tensor_meta"):  # torch 2.11: the buffer was the receive's only description
                info.tensor_meta = torch.empty_like(buffer, device="meta").requires_grad_(buffer.requires_grad)
            info.buffer = None
        out.append(info)
    return tuple(out)


def _buffer_from(meta, device: torch.device) -> torch.Tensor:
    if isinstance(meta, torch.Tensor):  # torch 2.11: the received tensor is itself autograd's leaf
        return torch.empty(meta.shape, dtype=meta.dtype, device=device).requires_grad_(meta.requires_grad)
    return torch_stage._make_tensor_from_meta(meta, device)


class BoundedPipelineStage(PipelineStage):
    """torch's PipelineStage holding receive buffers only for the micro-batches in flight."""

    # -- set-up: describe every micro-batch's receive, allocate none ---------------------------

    if not DESCRIBES_RECEIVES:  # torch 2.11

        def _prepare_forward_infra(self, num_microbatches: int, args, kwargs=None, *more, **options):
            # torch's set-up for one micro-batch, as the template of every micro-batch's receive.
            outputs = super()._prepare_forward_infra(1, args, kwargs, *more, **options)
            template = _without_buffers(self.args_recv_info[0])
            for chunk in range(num_microbatches):
                self.args_recv_info[chunk] = template
            return outputs

        def clear_runtime_states(self) -> None:
            # torch 2.11's clears the gradient of every receive's buffer, assuming each has one.
            self.fwd_cache.clear()
            self.output_chunks.clear()
            for infos in self.args_recv_info.values():
                for info in infos:
                    if getattr(info, "buffer", None) is not None:
                        info.buffer.grad = None

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        # torch's own set-up for one micro-batch, as the template of every micro-batch's receive
        # (its one buffer is dropped at once: one transient buffer, not one per micro-batch).
        super()._setup_forward_recv_info(1, has_backward)
        template = _without_buffers(self.args_recv_info[0])
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = template

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
        return _without_buffers(super()._create_grad_recv_info(act_send_info))

    # -- a buffer per receive, created when it is needed --------------------------------------

    def _allocate(self, infos: tuple) -> tuple:
        fresh = []
        for info in infos:
            if getattr(info, "tensor_meta", None) is not None and info.buffer is None and not getattr(info, "is_root_arg", False):
                info = copy.copy(info)
                info.buffer = _buffer_from(info.tensor_meta, self.device)
            fresh.append(info)
        return tuple(fresh)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        self.args_recv_info[fwd_chunk_id] = self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def set_local_fwd_input(self, prev_stage_outputs, mb_index: int) -> None:
        # torch sets each info's buffer in place: give this micro-batch infos of its own first.
        self.args_recv_info[mb_index] = tuple(copy.copy(info) for info in self.args_recv_info[mb_index])
        super().set_local_fwd_input(prev_stage_outputs, mb_index)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if not self.has_backward or self.is_last:  # torch's stage receives nothing then (1F1B's eval asks)
            return []
        self.grad_recv_info[bwd_chunk_id] = self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        # torch sets each info's buffer in place to the tensor handed over, or zeroes the buffer
        # where the gradient is None: infos of this micro-batch's own, a buffer only for those.
        infos = []
        for info, grad in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs):
            infos.append(self._allocate((info,))[0] if grad is None else copy.copy(info))
        self.grad_recv_info[mb_index] = tuple(infos)
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    # -- let go once read ----------------------------------------------------------------------

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        # The received activation is now the leaf of this micro-batch's graph (held by fwd_cache
        # and autograd until its backward); the stage's receive info need not hold it.
        self.args_recv_info[fwd_chunk_id] = _without_buffers(self.args_recv_info[fwd_chunk_id])
        if not self.has_backward and self.is_last:
            # Forward only: nothing reads the output or the inputs again (1F1B still asks the
            # last stage for its sends, of which it has none).
            self.fwd_cache[fwd_chunk_id] = ((), ())
        return output

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not self.has_backward:
            self.fwd_cache.pop(fwd_chunk_id, None)  # forward only: the send holds the output
        return ops

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward: bool = False):
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if bwd_chunk_id in self.grad_recv_info:
            self.grad_recv_info[bwd_chunk_id] = _without_buffers(self.grad_recv_info[bwd_chunk_id])


def held_buffers(stage: PipelineStage) -> list[torch.Tensor]:
    """The receive buffers (and their gradients) a stage's receive infos hold now, one per storage."""
    seen, out = set(), []
    for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
        for info in infos:
            buffer = getattr(info, "buffer", None)
            for t in (buffer, getattr(buffer, "grad", None)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    out.append(t)
    return out
