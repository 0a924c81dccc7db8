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


def normed_sublayer(norm: Callable, layer: Callable, x: torch.Tensor, discard: bool) -> torch.Tensor:
    """layer(norm(x)); with `discard` (Megatron's 'layernorm' recomputation) the norm's output,
    which only the layer keeps, is released until backward."""
    out = layer(normed := norm(x))
    if discard:
        discard_until_backward([normed], lambda: [norm(x)], out)
    return out
