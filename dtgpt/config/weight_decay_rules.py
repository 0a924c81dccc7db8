"""The rule of [optimizer] apply_wd_to_qk_layernorm (Megatron's --apply-wd-to-qk-layernorm)."""

from __future__ import annotations

from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require


def check_apply_wd_to_qk_layernorm(cfg: Config) -> None:
    m = cfg.model
    # Megatron picks the norms by module name: with its default Transformer Engine layers the
    # multi-latent attention's query norm is fused into linear_q_up_proj and never decays, with
    # its local layers it is named q_layernorm and decays. Which one a script meant is unknown.
    _require(
        not (cfg.optimizer.apply_wd_to_qk_layernorm and m.multi_latent_attention and m.qk_layernorm),
        "optimizer.apply_wd_to_qk_layernorm=true is refused with model.multi_latent_attention=true and "
        "model.qk_layernorm=true: Megatron decays the query norm with its local layers but not with "
        "Transformer Engine's, so the run it names is not defined",
    )
