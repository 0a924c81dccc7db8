"""Megatron's --moe-router-force-load-balancing (model.moe_router_force_load_balancing), a
benchmarking mode: the router's logits are replaced by standard normal draws, so that each expert
gets about tokens * topk / experts tokens whatever the weights have learned.

As Megatron's: the replacement happens right after the gating linear, so everything downstream
reads the draws (scores, group-limited top-k, the expert bias's choice and its counts, capacity,
the load-balancing and z losses), and backward passes the gradient to the real logits unchanged
(a straight-through estimator: the router weights still train, from the losses on the draws).

Unlike Megatron's, the draws do not come from a per-rank generator (Megatron forks its
expert-parallel stream, so the draws depend on the layout and on how many tokens a rank held
before): each value is a function of (seed, the router's module name, the token's index in the
run, the expert), by the counter-based hash of layout-invariant dropout (dtgpt/counter_hash.py)
and Box-Muller, so every layout draws the same logits for the same token and trains the same
model (DESIGN invariant 1). A recomputed forward draws them again, identically.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from dtgpt.counter_hash import token_hash
from dtgpt.mtp import named_blocks


def standard_normal(seed: int, site: str, token_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(N, E) fp32 N(0, 1) draws for the tokens of token_index (N,) and experts 0..E-1: Box-Muller
    of two 32-bit hashes per value (u1 in (0, 1], u2 in [0, 1))."""
    experts = torch.arange(num_experts, device=token_index.device)
    tokens = token_index[:, None]
    u1 = (token_hash(seed, site, tokens, experts, 0).double() + 1.0) / 2.0**32
    u2 = token_hash(seed, site, tokens, experts, 1).double() / 2.0**32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).float()


class _StraightThrough(torch.autograd.Function):
    """Forward: `drawn`; backward: the gradient goes to `logits` unchanged. (logits + (drawn -
    logits).detach() would round the draws at the logits' magnitude, in bf16 badly.)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
        return drawn

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def forced_logits(logits: torch.Tensor, seed: int, site: str, token_index: torch.Tensor) -> torch.Tensor:
    """The draws in place of `logits` (N, E) (in their dtype), the gradient passing straight to them."""
    drawn = standard_normal(seed, site, token_index, logits.shape[-1]).to(logits.dtype)
    return _StraightThrough.apply(logits, drawn)


def apply_forced_balance(model: nn.Module, seed: int, tp_rank: int = 0, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Give each MoE router of `model` (a whole GPT or a stage) its seed, its site (the router's
    global module name) and, before each forward of its block, the token indices of the tokens
    it routes, in its order: the block's token_index (B, T) (this cp rank's chunks already), cut
    to this tp rank's sequence chunk under sequence parallelism, position-major as the layer
    flattens its tokens. Before recomputation wraps the blocks (its hooks then fire again on a
    recomputed forward)."""
    chunk, chunks = (tp_rank, tp) if sequence_parallel else (0, 1)
    for name, block in named_blocks(model).items():
        router = getattr(block.mlp, "router", None)  # an MoE layer's (a dense MLP has none)
        if router is None:
            continue
        router.forced_balance = (seed, f"{name}.mlp.router")

        def set_tokens(_block, args, kwargs, router=router):
            token_index = kwargs.get("token_index")
            if token_index is None:
                raise ValueError("model.moe_router_force_load_balancing needs the model's token_index input (dtgpt.step.rank_batch builds it)")
            router.token_index = token_index.chunk(chunks, dim=1)[chunk].transpose(0, 1).reshape(-1)

        block.register_forward_pre_hook(set_tokens, with_kwargs=True)
