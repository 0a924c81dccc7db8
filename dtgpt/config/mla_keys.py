"""The multi-latent attention keys of [model] (DeepSeek-V2/V3's attention), with Megatron-LM's
names, defaults and meanings. A base of ModelConfig (dtgpt/config/sections.py), as MoEKeys is;
the rules are dtgpt/config/mla_rules.py's, the module dtgpt/mla.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class MLAKeys:
    multi_latent_attention: bool = False
    """Multi-latent attention instead of (grouped-query) attention: queries, keys and values are
    projected up from small compressed vectors, and a RoPE part of every key is shared by all heads."""
    q_lora_rank: Optional[int] = None
    """Width of the compressed query (linear_q_down_proj, then linear_q_up_proj); unset: the
    queries are projected from the hidden state in one (linear_q_proj)."""
    kv_lora_rank: int = 32
    """Width of the compressed key/value vector (linear_kv_down_proj, then linear_kv_up_proj)."""
    qk_head_dim: int = 128
    """Query/key channels per head without position information."""
    qk_pos_emb_head_dim: int = 64
    """Query/key channels per head that RoPE rotates (the key's are shared by all heads)."""
    v_head_dim: int = 128
    """Value channels per head."""
    rope_type: Optional[str] = None
    """'rope' or 'yarn'; unset: 'yarn' under multi-latent attention, 'rope' otherwise (as Megatron)."""
    rotary_scaling_factor: float = 1.0
    """YaRN's context extension factor (1: plain RoPE frequencies)."""
    mscale: float = 1.0
    """YaRN's attention factor multiplies cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    mscale_all_dim: float = 0.0
    """The softmax scale is mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)."""
    original_max_position_embeddings: int = 4096
    """YaRN: the context the frequencies were trained for."""
    beta_fast: float = 32.0
    """YaRN: rotations over the original context above which a frequency is kept."""
    beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is divided by the factor (linear ramp between)."""

    @property
    def yarn(self) -> bool:
        """Whether multi-latent attention's RoPE uses YaRN's frequencies."""
        return self.multi_latent_attention and self.rope_type in (None, "yarn")
