"""An iteration's routing statistics: the load-balancing and z losses Megatron logs, tokens per
expert and dropped tokens, gathered from this rank's MoE layers into one vector that is summed
over every rank with the loss and the gradient norm (dtgpt.step: one all-reduce).

Every rank holds a disjoint share of what is counted (dp: other samples, tp under sequence
parallelism: other positions, pp: other layers), and each router's losses are shares that sum to
the micro-batch's loss (dtgpt/moe/router.py), so a plain sum over the world is the global figure.
The vector's layout comes from the config alone, the same on ranks without MoE layers.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.nn as nn

from dtgpt.config import ModelConfig
from dtgpt.log_format import moe_layer_loss_key
from dtgpt.moe.layer import MoELayer
from dtgpt.mtp import numbered_blocks

TOKENS_PER_EXPERT, DROPPED_TOKENS = "tokens_per_expert", "dropped_tokens"


def logged_losses(cfg: ModelConfig) -> list[str]:
    """Megatron's names of the router losses a run logs (only those with a weight, as Megatron)."""
    names = []
    if cfg.moe_router_load_balancing_type != "none" and cfg.moe_aux_loss_coeff > 0:
        names.append("load_balancing_loss" if cfg.moe_router_load_balancing_type == "aux_loss" else "seq_load_balancing_loss")
    if cfg.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def moe_layers(parts: Iterable[nn.Module]) -> dict[int, MoELayer]:
    """Global block number -> MoE layer, of the model parts this rank holds (dtgpt.mtp.numbered_blocks)."""
    return {i: block.mlp for part in parts for i, block in numbered_blocks(part).items() if isinstance(block.mlp, MoELayer)}


def set_aux_loss_scale(parts: Iterable[nn.Module], scale: float) -> None:
    """The gradient each router loss gets in backward (MoELayer.aux_loss_scale)."""
    for layer in moe_layers(parts).values():
        layer.aux_loss_scale = scale


@contextmanager
def uncounted(parts: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, the MoE layers in `parts` route stand-in tokens (a pipeline stage's shape-inferring
    forward): they count nothing of it."""
    layers = list(moe_layers(parts).values())
    for layer in layers:
        layer.counting = False
    try:
        yield
    finally:
        for layer in layers:
            layer.counting = True


class RoutingStats:
    """Vector layout: [each logged loss summed over layers, or with model.moe_per_layer_logging
    each layer's (layer by layer)] + [tokens per expert, layer by layer] + [dropped tokens per layer]."""

    def __init__(self, cfg: ModelConfig):
        self.names = logged_losses(cfg)
        self.layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        if cfg.is_moe_layer(cfg.num_layers - 1):  # the prediction modules' blocks are of the last block's kind
            self.layers += [cfg.num_layers + k for k in range(cfg.mtp_depth)]
        self.experts = cfg.num_experts
        self.loss_rows = len(self.layers) if cfg.moe_per_layer_logging else 1

    @property
    def size(self) -> int:
        return self.loss_rows * len(self.names) + len(self.layers) * (self.experts + 1)

    def local(self, parts: Iterable[nn.Module], device: torch.device) -> torch.Tensor:
        """This rank's shares since the last call (taken from its layers, which start again at zero)."""
        losses = torch.zeros(self.loss_rows, len(self.names), device=device)
        tokens = torch.zeros(len(self.layers), self.experts, device=device)
        dropped = torch.zeros(len(self.layers), device=device)
        for index, layer in moe_layers(parts).items():
            totals, row = layer.take_totals(), self.layers.index(index)
            for i, name in enumerate(self.names):
                losses[row if self.loss_rows > 1 else 0, i] += totals.get(name, 0.0)
            if totals:
                tokens[row] = totals[TOKENS_PER_EXPERT]
                dropped[row] = totals[DROPPED_TOKENS]
        return torch.cat([losses.flatten(), tokens.flatten(), dropped])

    def tokens_per_expert(self, reduced: torch.Tensor) -> torch.Tensor:
        """(MoE layers, E) from the summed vector."""
        start = self.loss_rows * len(self.names)
        return reduced[start : start + len(self.layers) * self.experts].view(len(self.layers), self.experts)

    def summary(self, reduced: list[float], microbatches: int) -> dict:
        """The record's MoE entries from the summed vector (as host numbers): each loss as Megatron
        logs it, the mean over the global batch's micro-batches and the MoE layers; per layer
        (model.moe_per_layer_logging), Megatron's `moe/<loss>_layer_<i>`, the mean over the
        micro-batches: the total is the mean of the layers' values."""
        n, start = len(self.names), self.loss_rows * len(self.names)
        rows = [reduced[r * n : (r + 1) * n] for r in range(self.loss_rows)]
        record = {name: sum(row[i] for row in rows) / (microbatches * len(self.layers)) for i, name in enumerate(self.names)}
        if self.loss_rows > 1:
            for layer, row in zip(self.layers, rows):
                record |= {moe_layer_loss_key(name, layer): row[i] / microbatches for i, name in enumerate(self.names)}
        tokens = reduced[start : start + len(self.layers) * self.experts]
        record[TOKENS_PER_EXPERT] = [[round(t) for t in tokens[i * self.experts : (i + 1) * self.experts]] for i in range(len(self.layers))]
        record[DROPPED_TOKENS] = round(sum(reduced[start + len(tokens) :]))
        return record

    def update_expert_biases(self, parts: Iterable[nn.Module], reduced: torch.Tensor) -> None:
        """Aux-loss-free balancing after the iteration, from its tokens per expert over every rank."""
        per_layer = self.tokens_per_expert(reduced)
        for index, layer in moe_layers(parts).items():
            layer.router.update_expert_bias(per_layer[self.layers.index(index)])
