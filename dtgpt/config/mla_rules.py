"""The rules of the multi-latent attention keys ([model] multi_latent_attention, q_lora_rank,
..., YaRN's): check_mla needs no world size."""

from __future__ import annotations

import dataclasses

from dtgpt.config.mla_keys import MLAKeys
from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require


_LATENT_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(MLAKeys) if f.name not in ("multi_latent_attention", "rope_type")
}
"""The keys only multi-latent attention reads, at their defaults: set without it, they would change nothing."""


def check_mla(cfg: Config) -> None:
    m = cfg.model
    _require(
        m.rope_type in (None, "rope", "yarn"), f"model.rope_type={m.rope_type!r} is not one of: None, 'rope', 'yarn'"
    )
    if not m.multi_latent_attention:
        _require(
            m.rope_type in (None, "rope"),
            f"model.rope_type={m.rope_type!r} needs model.multi_latent_attention=true (YaRN is implemented for it only)",
        )
        for key, default in _LATENT_DEFAULTS.items():
            _require(
                getattr(m, key) == default,
                f"model.{key}={getattr(m, key)} needs model.multi_latent_attention=true (only multi-latent attention reads it)",
            )
        return
    _require(
        not m.group_query_attention,
        "model.multi_latent_attention=true excludes model.group_query_attention=true (every head has its own keys and values)",
    )
    _require(
        m.position_embedding_type == "rope",
        f"model.multi_latent_attention=true needs model.position_embedding_type='rope' (got {m.position_embedding_type!r}): "
        "its RoPE rotates the qk_pos_emb_head_dim channels of each head",
    )
    _require(m.q_lora_rank is None or m.q_lora_rank > 0, f"model.q_lora_rank={m.q_lora_rank} must be > 0 (or unset)")
    for key in ("kv_lora_rank", "qk_head_dim", "v_head_dim", "original_max_position_embeddings"):
        _require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0")
    d = m.qk_pos_emb_head_dim
    _require(d > 0 and d % 2 == 0, f"model.qk_pos_emb_head_dim={d} must be even and > 0 (RoPE rotates channel pairs)")
    _require(m.rotary_scaling_factor > 0, f"model.rotary_scaling_factor={m.rotary_scaling_factor} must be > 0")
    _require(
        m.beta_fast > m.beta_slow > 0, f"model.beta_fast={m.beta_fast} must be > model.beta_slow={m.beta_slow} > 0"
    )
    for key, wanted in (("rotary_interleaved", False), ("use_rope_scaling", False), ("rotary_percent", 1.0)):
        _require(
            getattr(m, key) == wanted,
            f"model.{key}={getattr(m, key)} is not supported with model.multi_latent_attention=true (needs {wanted}): "
            "its RoPE rotates every qk_pos_emb_head_dim channel, in Megatron's de-interleaved order",
        )
