"""Output-discarding recomputation: free tensors backward would keep, and rebuild them just before
backward reads them.

What Megatron-LM's 'layernorm', 'mla_up_proj' and 'moe_act' recomputation does: a norm's output
is kept only as its consumer's input (the QKV or fc1 matmul's), so the consumer runs, then the
output's storage is released; a gradient hook on the consumer's output, which fires before the
consumer's backward, computes the output again from the inputs (kept anyway) and writes it back
into the same storage. Autograd's saved tensors are views of that storage, so they see the values
again; the write goes through `.data`, which does not move the version counter autograd checks.

Plain single-device PyTorch. Only a tensor that owns its storage and is a plain torch.Tensor is
released: a DTensor (a sequence-parallel norm's output) is kept, since what its consumer saves is
another tensor (the gathered input), which releasing it would not free.

`run_without_saving` is the same for a function whose own backward is needed too ('mla_up_proj':
the up-projections and RoPE): its forward keeps only its inputs, and the one recomputation that
refills its discarded outputs builds the graph its backward then runs, so that the function (and
any collective in it) runs twice in all, as Megatron's, not three times (a refill, then a
checkpoint's own replay).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def _releasable(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.untyped_storage().nbytes() > 0


def discard_until_backward(
    outputs: Sequence[torch.Tensor], recompute: Callable[[], Sequence[torch.Tensor]], consumer_output: torch.Tensor
) -> None:
    """Release the storage of each of `outputs` now; refill them with `recompute()` (run without
    grad, once, returning tensors of the same shapes in the same order) when backward reaches
    `consumer_output`. Call it right after the consumer's forward, when nothing else reads them."""
    if not torch.is_grad_enabled() or not consumer_output.requires_grad:
        return  # no backward will read them: nothing to release
    kept = [(i, t, t.untyped_storage().nbytes()) for i, t in enumerate(outputs) if _releasable(t)]
    if not kept:
        return
    for _, t, _ in kept:
        t.untyped_storage().resize_(0)

    def refill(grad: torch.Tensor) -> None:
        if all(t.untyped_storage().nbytes() for _, t, _ in kept):
            return  # a second backward over the same graph: already there
        with torch.no_grad():
            fresh = recompute()
        for i, t, nbytes in kept:
            t.untyped_storage().resize_(nbytes)
            t.data.copy_(fresh[i])

    consumer_output.register_hook(refill)


_SAVED = object()  # marks an input that went through save_for_backward


class _RunWithoutSaving(torch.autograd.Function):
    """outputs = run(*inputs), keeping only the inputs for backward; backward runs the graph the
    refill left in `graph` (or builds it then, if nothing was discarded)."""

    @staticmethod
    def forward(ctx, run, graph, *inputs):
        # the tensors through save_for_backward (what autograd keeps is counted, and checked
        # for in-place changes), the rest (None, numbers) as they are
        ctx.run, ctx.graph = run, graph
        ctx.others = [_SAVED if isinstance(x, torch.Tensor) else x for x in inputs]
        ctx.save_for_backward(*(x for x in inputs if isinstance(x, torch.Tensor)))
        return tuple(run(*inputs))

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if x is _SAVED else x for x in ctx.others]
        leaves, outputs = ctx.graph.pop("built", None) or _build_graph(ctx.run, inputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves))


def _build_graph(run: Callable, inputs: Sequence) -> tuple[list, Sequence[torch.Tensor]]:
    """run(*inputs) again with grad, from detached copies of the inputs: (those leaves, outputs)."""
    leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
    with torch.enable_grad():
        return leaves, run(*leaves)


def run_without_saving(run: Callable[..., Sequence[torch.Tensor]], *inputs) -> tuple[Sequence[torch.Tensor], Callable]:
    """`run(*inputs)`'s outputs, computed without saving anything for backward but the inputs, and
    `discard`: called with the consumer's output right after the consumer ran, it releases the
    outputs' storage until backward reaches that output, then runs `run` once more (with grad) to
    refill them and to give `run`'s own backward its graph. Without grad: the outputs, and a no-op."""
    if not torch.is_grad_enabled():
        return run(*inputs), lambda consumer_output: None
    graph: dict = {}
    outputs = _RunWithoutSaving.apply(run, graph, *inputs)

    def rebuild() -> Sequence[torch.Tensor]:
        graph["built"] = _build_graph(run, inputs)
        return [o.detach() for o in graph["built"][1]]

    return outputs, lambda consumer_output: discard_until_backward(outputs, rebuild, consumer_output)


def normed_sublayer(norm: Callable, layer: Callable, x: torch.Tensor, discard: bool) -> torch.Tensor:
    """layer(norm(x)); with `discard` (Megatron's 'layernorm' recomputation) the norm's output,
    which only the layer keeps, is released until backward."""
    out = layer(normed := norm(x))
    if discard:
        discard_until_backward([normed], lambda: [norm(x)], out)
    return out
