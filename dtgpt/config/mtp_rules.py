"""The rules of the multi-token prediction keys ([model] mtp_num_layers, mtp_loss_scaling_factor):
check_mtp needs no world size."""

from __future__ import annotations

import math

from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require


def check_mtp(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers is None:
        _require(
            m.mtp_loss_scaling_factor == 0.1,
            f"model.mtp_loss_scaling_factor={m.mtp_loss_scaling_factor} needs model.mtp_num_layers "
            "(only multi-token prediction reads it)",
        )
        return
    _require(m.mtp_num_layers >= 1, f"model.mtp_num_layers={m.mtp_num_layers} must be >= 1 (or unset: no multi-token prediction)")
    _require(
        math.isfinite(m.mtp_loss_scaling_factor) and m.mtp_loss_scaling_factor >= 0,
        f"model.mtp_loss_scaling_factor={m.mtp_loss_scaling_factor} must be a finite number >= 0",
    )
    _require(
        p.pipeline_model_parallel_size == 1 or m.position_embedding_type != "learned_absolute",
        f"model.mtp_num_layers={m.mtp_num_layers} with parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size} "
        "needs model.position_embedding_type='rope' (the last stage shares the word embedding only, not the position embedding)",
    )
