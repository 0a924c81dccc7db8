"""The attention and activation variants of [model] that gpt-oss made common, with Megatron-LM's
names, defaults and meanings: sliding-window attention, attention sinks (softmax_type), the clamped,
offset SwiGLU, and Llama 4's qk L2 norm and NoPE blocks. A base of ModelConfig (dtgpt/config/sections.py), as MLAKeys
is; the rules are dtgpt/config/attention_rules.py's, the modules dtgpt/model.py's CoreAttention,
dtgpt/attention_sink.py and dtgpt/mlp.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dtgpt.config.layer_freq import layer_pattern


VARIANTS_OFF = {"window_size": None, "window_attn_skip_freq": 0, "softmax_type": "vanilla", "qk_l2_norm": False,
                "no_rope_freq": 0, "glu_linear_offset": 0.0, "activation_func_clamp_value": None}  # fmt: skip
"""These keys at their defaults: what a format without them (GPT-2's, Llama's, DeepSeek-V3's) needs."""


@dataclass
class AttentionVariantKeys:
    window_size: Optional[list[int]] = None
    """Sliding-window attention, [left, right] as Transformer Engine's window: query i sees keys
    i - left .. i + right (-1: unbounded). GPT attention is causal, so right must be 0; unset: full
    causal attention in every block."""
    window_attn_skip_freq: int | str = 0
    """Which blocks keep full attention under window_size. An int N: block i (from 1) is windowed
    unless i % N == 0 (one full block after N - 1 windowed ones); or a per-block list of 0/1 as
    text, 1 = windowed, e.g. "[1,0]*6"; 0 (Megatron's None): every block windowed."""
    softmax_type: str = "vanilla"
    """'vanilla', 'off-by-one' (one more term, e^0, in the softmax's denominator: a sink no key
    fills) or 'learnable' (the sink's logit a learned parameter per head, softmax_offset)."""
    glu_linear_offset: float = 0.0
    """SwiGLU: silu(gate) * (fc1 + offset) (gpt-oss: 1)."""
    qk_l2_norm: bool = False
    """Llama 4's query and key norm: each head's q and k divided by their root mean square (no
    weights, eps norm_epsilon), where qk_layernorm would normalise them."""
    no_rope_freq: int | str = 0
    """Blocks that skip RoPE (Llama 4's NoPE layers). An int N: every N-th block (from 1); or a
    per-block list of 0/1 as text, 1 = no RoPE, e.g. "([0]*3+[1])*2"; 0 (Megatron's None): none."""
    activation_func_clamp_value: Optional[float] = None
    """SwiGLU: the gate clamped to at most this, fc1 to [-this, this], before the product (gpt-oss: 7,
    DeepSeek-V4: 10)."""

    def skips_rope(self, index: int) -> bool:
        """Whether block `index` (from 0) attends without RoPE (no_rope_freq)."""
        freq = self.no_rope_freq
        if isinstance(freq, str) and freq.strip().isdigit():
            freq = int(freq)
        if not freq:
            return False
        if isinstance(freq, int):
            return (index + 1) % freq == 0
        return layer_pattern(freq, self.num_layers, "model.no_rope_freq")[index]

    def attention_window(self, index: int) -> Optional[int]:
        """How far back block `index` (from 0) attends (its window's left side), or None: full causal."""
        if not self.window_size or self.window_size[0] < 0:
            return None
        freq = self.window_attn_skip_freq
        if freq and not layer_pattern(freq, self.num_layers, "model.window_attn_skip_freq", from_one=True)[index]:
            return None
        return self.window_size[0]
