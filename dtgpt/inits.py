"""The initialisations a module may declare for its parameters (`declared_inits()`): the
vocabulary dtgpt.model's init_weights reads, shared with the MoE modules (dtgpt/moe)."""

from __future__ import annotations

import enum
import zlib

import torch
import torch.nn as nn


class Init(enum.Enum):
    """The initialisations a module may declare for its parameters (Megatron's GPT init)."""

    NORMAL = "normal"
    """N(0, init_method_std): Megatron's init_method."""
    SCALED_NORMAL = "scaled_normal"
    """N(0, init_method_std / sqrt(2 * num_layers)): Megatron's output_layer_init_method, for the
    projections that write into the residual stream."""
    ZEROS = "zeros"
    ONES = "ones"


DeclaredInits = list[tuple[nn.Parameter, Init]]


def linear_inits(linear: nn.Linear, weight: Init) -> DeclaredInits:
    """A linear layer's weight gets `weight`; its bias, if any, starts at zero."""
    inits = [(linear.weight, weight)]
    if linear.bias is not None:
        inits.append((linear.bias, Init.ZEROS))
    return inits


def named_normal(name: str, shape, std: float, seed: int, device: torch.device) -> torch.Tensor:
    """N(0, std) of `shape`, drawn from a generator seeded by (seed, name) alone: a parameter's
    initial value never depends on which other parameters a rank holds or the order of the draws."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)
