"""The rules of [optimizer] decoupled_lr and decoupled_min_lr (Megatron's --decoupled-lr and
--decoupled-min-lr), and the LR bounds they give the word embedding and the output layer."""

from __future__ import annotations

import math

from dtgpt.config.sections import Config, OptimizerConfig
from dtgpt.config.sections import require as _require


def embedding_output_bounds(o: OptimizerConfig) -> tuple[float, float]:
    """(peak, minimum) LR of the word embedding and the output layer: decoupled_lr and
    decoupled_min_lr where set (the minimum falls back to min_lr, as Megatron's), else lr and min_lr."""
    if o.decoupled_lr is None:
        return o.lr, o.min_lr
    return o.decoupled_lr, o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr


def check_decoupled_lr(cfg: Config) -> None:
    o = cfg.optimizer
    if o.decoupled_lr is None:
        # Megatron ignores it there; a bound that changes nothing is refused rather than dropped.
        _require(
            o.decoupled_min_lr is None,
            f"optimizer.decoupled_min_lr={o.decoupled_min_lr} needs optimizer.decoupled_lr (the embedding and output "
            "layer follow optimizer.lr and optimizer.min_lr without it)",
        )
        return
    peak, low = embedding_output_bounds(o)
    for key, value in (("optimizer.decoupled_lr", o.decoupled_lr), ("optimizer.decoupled_min_lr", o.decoupled_min_lr)):
        _require(value is None or (math.isfinite(value) and value >= 0), f"{key}={value} must be a finite number >= 0")
    low_key = "optimizer.min_lr" if o.decoupled_min_lr is None else "optimizer.decoupled_min_lr"
    _require(low <= peak, f"{low_key}={low} must be <= optimizer.decoupled_lr={peak} (the embedding and output layer's LR range)")
