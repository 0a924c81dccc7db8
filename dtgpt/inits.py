"""The initialisations a module may declare for its parameters (`declared_inits()`): the
vocabulary dtgpt.model's init_weights reads, shared with the MoE modules (dtgpt/moe)."""

from __future__ import annotations

import enum

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
