"""Megatron's precision regime on a mesh of one, without FSDP: a compute-dtype copy of the weights.

Under fp16/bf16 the model computes in the low-precision dtype over fp32 master weights that the
optimizer steps, and gradients are accumulated in fp32 (DESIGN invariant 7). On several ranks
FSDP's MixedPrecisionPolicy is that regime (dtgpt/parallel/fsdp.py). In one process FSDP would
move nothing, yet its per-unit hooks, its DTensor parameters and its copies cost host time on
every step (docs/performance.md, "One process"), so here the regime is built as Megatron builds
it (its Float16Module with main parameters):

- the model part keeps its fp32 parameters: they are the masters, and everything that names a
  weight sees them (AdamW, the gradient norm and clip, checkpoints, which stay mesh-free);
- a twin of the part (`module`) holds the weights in the compute dtype and runs forward and
  backward. Its weights are refreshed from the masters with one copy whenever the masters have
  changed (the optimizer step, a checkpoint load: both write them in place, which the version
  counter of the one buffer they live in records);
- its gradients land in one compute-dtype buffer and are moved to the masters' fp32 gradients
  (one buffer, viewed by each master's `.grad`) after every micro-batch's backward: added in fp32
  when gradients accumulate in fp32, as FSDP accumulates them, or once after the last one in the
  compute dtype (fp16 without training.accumulate_allreduce_grads_in_fp32).

The values are FSDP's at one rank, bit for bit: the same cast of the same masters, the same
backward, the same fp32 sums.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


def _flatten(params: list[nn.Parameter], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One buffer holding every parameter's values in `dtype`, and each parameter's view of it."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return flat, views


def _replace_params(module: nn.Module, new: dict[int, nn.Parameter]) -> None:
    """Re-register every parameter (shared ones stay shared) as the one `new` maps its id to."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            setattr(sub, name, new[id(p)])


class ComputeCopy:
    """The compute-dtype twin of one model part whose parameters are fp32 masters."""

    def __init__(self, master: nn.Module, dtype: torch.dtype, accumulate_dtype: torch.dtype):
        originals = list(dict.fromkeys(master.parameters()))  # a tied weight once
        device = originals[0].device
        self.master = master
        self.accumulate_in_fp32 = accumulate_dtype == torch.float32
        # The masters move into one fp32 buffer: new Parameters over its views, which share its
        # version counter, so an in-place write to any master shows on the buffer.
        self.master_flat, views = _flatten(originals, torch.float32, device)
        with torch.no_grad():
            for view, p in zip(views, originals):
                view.copy_(p)
        new = {id(p): nn.Parameter(v, requires_grad=p.requires_grad) for p, v in zip(originals, views)}
        _replace_params(master, new)
        self.masters = [new[id(p)] for p in originals]
        # The twin: the part's modules copied with stand-ins for the parameters (nothing is
        # allocated for them) and its buffers shared, then given compute-dtype parameters.
        stand_ins = {id(p): torch.empty(0, device="meta") for p in self.masters}
        memo = {**stand_ins, **{id(b): b for b in master.buffers()}}
        self.module = copy.deepcopy(master, memo)
        self.flat, views = _flatten(self.masters, dtype, device)
        twins = [nn.Parameter(v, requires_grad=p.requires_grad) for p, v in zip(self.masters, views)]
        _replace_params(self.module, {id(stand_ins[id(p)]): t for p, t in zip(self.masters, twins)})
        self.grad_flat, grad_views = _flatten(self.masters, dtype, device)
        self.grad_flat.zero_()
        for twin, view in zip(twins, grad_views):
            if twin.requires_grad:
                twin.grad = view  # backward adds into it in place (AccumulateGrad with a grad present)
        self.master_grad_flat, master_grad_views = _flatten(self.masters, torch.float32, device)
        self._trainable = [(m, g) for m, g in zip(self.masters, master_grad_views) if m.requires_grad]
        self._seen_version = -1

    @torch.no_grad()
    def forward_module(self) -> nn.Module:
        """The twin, its weights current with the masters and its mode the part's.

        A tensor's `_version` counts the in-place writes to its storage (autograd's own check;
        checked on torch 2.13): tests/test_compute_copy.py fails if a checkpoint load stops
        reaching the copy."""
        if self.master_flat._version != self._seen_version:
            self.flat.copy_(self.master_flat)
            self._seen_version = self.master_flat._version
        if self.module.training != self.master.training:
            self.module.train(self.master.training)
        return self.module

    @torch.no_grad()
    def collect_grads(self, first: bool, last: bool) -> None:
        """After one micro-batch's backward: move the twin's gradients to the masters' (fp32)."""
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
