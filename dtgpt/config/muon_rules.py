"""The rules of the Muon keys ([optimizer] muon_*, dtgpt/config/muon_keys.py): check_muon needs no
world size. Megatron reads them only under --optimizer muon, so they are checked only then."""

from __future__ import annotations

from dtgpt.config.muon_keys import MUON_OPTIMIZERS
from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require

__all__ = ["MUON_OPTIMIZERS", "COEFFICIENT_TYPES", "check_muon"]

COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4")
"""The Newton-Schulz coefficient sets of emerging-optimizers 0.3.0 (dtgpt/muon.py holds them)."""
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
TP_MODES = ("duplicated", "distributed", "blockwise")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"optimizer.{key}={value!r} is not one of: {', '.join(map(repr, choices))}")


def check_muon(cfg: Config) -> None:
    o = cfg.optimizer
    if not o.uses_muon:
        return
    _choice("muon_scale_mode", o.muon_scale_mode, SCALE_MODES)
    _choice("muon_coefficient_type", o.muon_coefficient_type, COEFFICIENT_TYPES)
    _choice("muon_tp_mode", o.muon_tp_mode, TP_MODES)
    _require(
        o.muon_fp32_matmul_prec in ("medium", "high"),
        f"optimizer.muon_fp32_matmul_prec={o.muon_fp32_matmul_prec!r} is refused: torch's float32 matmul precision "
        "is 'medium' (Newton-Schulz in bf16) or 'high' (fp32); Megatron passes 'low' to torch, which rejects it",
    )
    _require(o.muon_num_ns_steps >= 1, f"optimizer.muon_num_ns_steps={o.muon_num_ns_steps} must be >= 1")
    _require(
        o.muon_scalar_optimizer == "adam",
        f"optimizer.muon_scalar_optimizer={o.muon_scalar_optimizer!r} is refused: dtgpt trains what Muon does not "
        "take (embedding, output layer, biases, norms) with adam only; drop the flag or give adam",
    )
    tp = cfg.parallel.tensor_model_parallel_size
    _require(
        o.muon_tp_mode != "blockwise" or tp == 1,
        f"optimizer.muon_tp_mode='blockwise' is refused at parallel.tensor_model_parallel_size={tp}: it orthogonalises "
        "each tp shard alone, so the update depends on tp; dtgpt builds the whole matrix's (give duplicated)",
    )
    _require(
        not cfg.training.fp16,
        f"optimizer.optimizer={o.optimizer!r} is refused with training.fp16=true: Megatron's Muon has no loss "
        "scaling (it refuses fp16); use training.bf16",
    )
