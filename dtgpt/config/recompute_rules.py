"""Which submodules selective recomputation recomputes (`training.recompute_modules`), and its rules.

Megatron-LM's names and rules (its TransformerConfig's checks, tested against megatron-core in
tests/test_recompute_modules.py): every name is one Megatron knows; 'moe_act' needs the grouped
GEMM experts and 'mla_up_proj' multi-latent attention; the older `moe_layer_recompute` is
'selective' with 'moe' added, and refused with 'full'. dtgpt adds one rule: a list set without
'selective' is refused (Megatron ignores it), as recompute_method is without 'full'.
"""

from __future__ import annotations

from dtgpt.config.sections import Config, TrainingConfig
from dtgpt.config.sections import require as _require

MODULES = ("core_attn", "mlp", "moe", "shared_experts", "layernorm", "mla_up_proj", "moe_act")
DEFAULT_MODULES = ("core_attn",)
UNBUILT = {
    "gdn_norm_out": "the gated delta net's output norm",
    "gdp_in_proj": "the gated delta product's input projection",
    "gdp_qkv": "the gated delta product's convolution",
    "mhc": "hyper-connections",
}
"""Names newer Megatron releases accept for parts dtgpt's model does not have."""


def selective_modules(t: TrainingConfig) -> tuple[str, ...]:
    """The submodules every block recomputes: none unless granularity is 'selective'; in order, once each."""
    if t.recompute_granularity != "selective":
        return ()
    return tuple(dict.fromkeys(DEFAULT_MODULES if t.recompute_modules is None else t.recompute_modules))


def apply_moe_layer_recompute(cfg: Config) -> None:
    """In place: Megatron's moe_layer_recompute as the keys it stands for (idempotent)."""
    t = cfg.training
    if not t.moe_layer_recompute:
        return
    _require(
        t.recompute_granularity != "full",
        "training.moe_layer_recompute=true cannot go with training.recompute_granularity='full' (it is selective "
        "recomputation of the MoE layer); unset one of them",
    )
    t.recompute_granularity = "selective"
    modules = list(DEFAULT_MODULES if t.recompute_modules is None else t.recompute_modules)
    t.recompute_modules = modules + ["moe"] * ("moe" not in modules)


def check_recompute_modules(cfg: Config) -> None:
    t, m = cfg.training, cfg.model
    if t.recompute_modules is None:
        return
    listed = f"training.recompute_modules={t.recompute_modules!r}"
    _require(
        t.recompute_granularity == "selective",
        f"{listed} applies only to training.recompute_granularity='selective' (it is {t.recompute_granularity!r}); "
        "set recompute_granularity='selective' or leave recompute_modules unset",
    )
    for name in t.recompute_modules:
        _require(
            name not in UNBUILT,
            f"{listed}: {name!r} recomputes {UNBUILT.get(name)}, which dtgpt's model does not have; remove it",
        )
        _require(name in MODULES, f"{listed}: {name!r} is not one of {', '.join(MODULES)}")
    _require(
        "moe_act" not in t.recompute_modules or m.moe_grouped_gemm,
        f"{listed}: 'moe_act' needs model.moe_grouped_gemm=true (as Megatron); set it or remove 'moe_act'",
    )
    _require(
        "mla_up_proj" not in t.recompute_modules or m.multi_latent_attention,
        f"{listed}: 'mla_up_proj' needs model.multi_latent_attention=true (as Megatron); remove 'mla_up_proj'",
    )
