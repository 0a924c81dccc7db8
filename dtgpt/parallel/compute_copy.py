"""Megatron's precision regime without FSDP where no rank shares a weight: a compute-dtype copy.

Under fp16/bf16 the model computes in the low-precision dtype over fp32 master weights that the
optimizer steps, and gradients are accumulated in fp32 (DESIGN invariant 7). Where ranks share a
weight (dp x cp > 1) FSDP's MixedPrecisionPolicy is that regime (dtgpt/parallel/fsdp.py). Where
none does (one process, and tp or pp at dp = cp = 1) FSDP would move nothing, yet its per-unit
hooks, its casts and its copies cost host time on every step (docs/performance.md, "One
process" and "On a mesh"), so there the regime is built as Megatron builds it (its Float16Module
with main parameters):

- each model part keeps its fp32 parameters (plain, or DTensors over tp): they are the masters,
  and everything that names a weight sees them (AdamW, the gradient norm and clip, the tied
  copies' sum, checkpoints, which stay mesh-free);
- a twin of the part (`module`, the same part built and parallelised a second time, the
  modules tp replicates left plain) holds the weights in the compute dtype and runs forward and
  backward. Its weights are cast from the masters with one copy before each run (after the
  optimizer step, a checkpoint load);
- its gradients land in one compute-dtype buffer and are moved to the masters' fp32 gradients
  (one buffer, viewed by each master's `.grad`) after every micro-batch's backward: added in fp32
  when gradients accumulate in fp32, as FSDP accumulates them, or once after the last one in the
  compute dtype (fp16 without training.accumulate_allreduce_grads_in_fp32, bf16 with
  training.grad_reduce_in_bf16). A gradient that
  DTensor leaves as a pending sum over tp (Partial) stays one in the masters' gradient, and is
  summed once per iteration with the others (ModelParts.reduce_pending_grads).

In one process the values are FSDP's at one rank, bit for bit: the same cast of the same
masters, the same backward, the same fp32 sums. Under tp the pending sums are summed in the
dtype gradients are reduced in (fp32 under bf16, as Megatron sums them in its main gradients),
where FSDP summed each alone in the compute dtype after one micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _like(view: torch.Tensor, param: torch.Tensor, placements=None) -> torch.Tensor:
    """`view` (local values) as `param` is laid out: a DTensor of its mesh, or plain."""
    if not isinstance(param, DTensor):
        return view
    placements = param.placements if placements is None else placements
    return DTensor.from_local(view, param.device_mesh, placements, run_check=False, shape=param.shape, stride=param.stride())


def _flatten(params: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One buffer holding every parameter's local values in `dtype`, and each one's view of it."""
    shapes = [_local(p).shape for p in params]
    flat = torch.empty(sum(s.numel() for s in shapes), dtype=dtype, device=device)
    views, offset = [], 0
    for shape in shapes:
        views.append(flat[offset : offset + shape.numel()].view(shape))
        offset += shape.numel()
    return flat, views


def _replace_params(module: nn.Module, new: dict[int, nn.Parameter]) -> None:
    """Re-register every parameter (shared ones stay shared) as the one `new` maps its id to."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            setattr(sub, name, new[id(p)])


class ComputeCopy:
    """The compute-dtype twin of one model part whose parameters are fp32 masters.

    `twin`: the same part built and parallelised again, its parameters not materialised (on
    meta): they become views of one compute-dtype buffer here, its buffers the master's own.
    """

    def __init__(self, master: nn.Module, twin: nn.Module, dtype: torch.dtype, accumulate_dtype: torch.dtype):
        named = dict(master.named_parameters())  # each parameter once: a tied weight under its first name
        originals = list(named.values())
        twin_named = dict(twin.named_parameters())
        if list(twin_named) != list(named):
            raise RuntimeError(f"the compute copy's parameters {list(twin_named)} differ from the part's {list(named)}")
        device = _local(originals[0]).device
        self.master = master
        self.accumulate_in_fp32 = accumulate_dtype == torch.float32
        # The masters move into one fp32 buffer: new Parameters over its views.
        self.master_flat, views = _flatten(originals, torch.float32, device)
        with torch.no_grad():
            for view, p in zip(views, originals):
                view.copy_(_local(p))
        new = {id(p): nn.Parameter(_like(v, p), requires_grad=p.requires_grad) for p, v in zip(originals, views)}
        _replace_params(master, new)
        self.masters = [new[id(p)] for p in originals]
        self.module = twin
        for name, buffer in master.named_buffers():
            owner, _, key = name.rpartition(".")
            twin.get_submodule(owner)._buffers[key] = buffer
        self.flat, views = _flatten(self.masters, dtype, device)
        self.twins = [
            nn.Parameter(_like(v, t), requires_grad=t.requires_grad) for t, v in zip(twin_named.values(), views)
        ]
        _replace_params(twin, {id(t): new_t for t, new_t in zip(twin_named.values(), self.twins)})
        self.grad_flat, self._grad_views = _flatten(self.masters, dtype, device)
        self.grad_flat.zero_()
        self.master_grad_flat, self._master_grad_views = _flatten(self.masters, torch.float32, device)
        self._trainable: list[tuple[nn.Parameter, torch.Tensor]] | None = None  # (master, its gradient): set by the first backward
        self._micro_batches = 0  # collected since the last one of an iteration (pipeline stages count here)

    @torch.no_grad()
    def refresh(self) -> nn.Module:
        """The twin, its weights cast from the masters (one copy) and its mode the part's.

        Called once per run of the part (an iteration's forward-backward, an evaluation batch),
        as Megatron copies its main parameters to the model's after every optimizer step: every
        write to the masters (the optimizer's, a checkpoint load's) reaches the copy. Whether
        the masters changed cannot be read off cheaply: a DTensor's in-place update in DTensor's
        dispatch moves no version counter (torch 2.13)."""
        self.flat.copy_(self.master_flat)
        if self.module.training != self.master.training:
            self.module.train(self.master.training)
        return self.module

    @torch.no_grad()
    def _adopt_grads(self) -> None:
        """After the first backward: each twin's gradient becomes a view of the one buffer, laid
        out as backward gave it (a pending sum over tp stays Partial), so that every later
        backward adds into the buffer in place; each master's fp32 gradient is laid out the same."""
        self._trainable = []
        for twin, master, view, master_view in zip(self.twins, self.masters, self._grad_views, self._master_grad_views):
            if not twin.requires_grad:
                continue
            grad, placements = twin.grad, None  # None: the parameter's own (an unused weight's zero gradient)
            if isinstance(grad, DTensor) and grad._local_tensor.shape == view.shape:
                placements = grad.placements
            elif isinstance(grad, DTensor):  # a whole replicated gradient of a shard: its rows
                grad = grad.redistribute(twin.device_mesh, twin.placements)
            if grad is not None:
                view.copy_(_local(grad))
            twin.grad = _like(view, twin, placements)  # AccumulateGrad adds into a present gradient in place
            self._trainable.append((master, _like(master_view, master, placements)))

    @torch.no_grad()
    def collect_grads(self, first: bool, last: bool) -> None:
        """After one micro-batch's backward: move the twin's gradients to the masters' (fp32)."""
        if self._trainable is None:
            self._adopt_grads()
        if self.accumulate_in_fp32:
            if first:
                self.master_grad_flat.copy_(self.grad_flat)
            else:
                self.master_grad_flat.add_(self.grad_flat)
            self.grad_flat.zero_()
        elif last:  # accumulated in the compute dtype by backward itself
            self.master_grad_flat.copy_(self.grad_flat)
            self.grad_flat.zero_()
        if last:
            for master, grad in self._trainable:
                master.grad = grad

    def after_stage_backward(self, last: bool) -> None:
        """collect_grads for a pipeline stage, whose schedule says only which backward is the last."""
        self.collect_grads(first=self._micro_batches == 0, last=last)
        self._micro_batches = 0 if last else self._micro_batches + 1
