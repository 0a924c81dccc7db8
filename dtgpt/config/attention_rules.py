"""The rules of the attention and activation variants ([model] window_size, window_attn_skip_freq,
softmax_type, glu_linear_offset, activation_func_clamp_value, qk_l2_norm, no_rope_freq):
check_attention_variants needs no world size."""

from __future__ import annotations

import math

from dtgpt.config.layer_freq import layer_pattern
from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_attention_variants(cfg: Config) -> None:
    m = cfg.model
    _require(m.softmax_type in SOFTMAX_TYPES, f"model.softmax_type={m.softmax_type!r} is not one of: {', '.join(map(repr, SOFTMAX_TYPES))}")
    _check_window(cfg)
    variants = [f"model.{key}={getattr(m, key)!r}" for key, off in (("window_size", None), ("softmax_type", "vanilla")) if getattr(m, key) != off]
    for what in variants:
        _require(
            not m.multi_latent_attention,
            f"{what} is not built with model.multi_latent_attention=true (dtgpt's windows and sinks are checked on grouped-query attention only)",
        )
        _require(
            m.dropout_rng != "layout_invariant" or m.attention_dropout == 0.0,
            f"{what} with model.dropout_rng='layout_invariant' and model.attention_dropout={m.attention_dropout}: "
            "the layout-invariant attention dropout has no window or sink; set attention_dropout=0 or dropout_rng='megatron'",
        )
    for key, off in (("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)):
        value = getattr(m, key)
        _require(value == off or m.swiglu, f"model.{key}={value} needs model.swiglu=true (it shapes the gated unit)")
    _check_llama4(cfg)
    clamp = m.activation_func_clamp_value
    _require(clamp is None or clamp > 0, f"model.activation_func_clamp_value={clamp} must be > 0 (or unset)")
    _require(math.isfinite(m.glu_linear_offset), f"model.glu_linear_offset={m.glu_linear_offset} must be finite")


def _check_llama4(cfg: Config) -> None:
    m = cfg.model
    for key, on in (("qk_l2_norm", m.qk_l2_norm), ("no_rope_freq", m.no_rope_freq)):
        _require(
            not on or not m.multi_latent_attention,
            f"model.{key}={getattr(m, key)!r} is not built with model.multi_latent_attention=true (its RoPE and norms are its own)",
        )
    _require(
        not (m.qk_l2_norm and m.qk_layernorm),
        "model.qk_l2_norm=true and model.qk_layernorm=true: choose one norm of the queries and keys",
    )
    freq = m.no_rope_freq
    if not freq:
        return
    _require(
        m.position_embedding_type == "rope",
        f"model.no_rope_freq={freq!r} needs model.position_embedding_type='rope' (it picks the blocks that skip RoPE)",
    )
    _require(
        not m.mtp_num_layers,
        f"model.no_rope_freq={freq!r} with model.mtp_num_layers={m.mtp_num_layers}: whether the prediction modules' "
        "blocks skip RoPE is not built; unset one",
    )
    if isinstance(freq, int) or freq.strip().isdigit():
        _require(
            int(freq) >= 1 and m.num_layers % int(freq) == 0,
            f"model.no_rope_freq={freq} must be >= 1 and divide model.num_layers={m.num_layers} (as Megatron's pattern)",
        )
        return
    try:
        layer_pattern(freq, m.num_layers, "model.no_rope_freq")
    except ValueError as e:
        _require(False, str(e))


def _check_window(cfg: Config) -> None:
    m = cfg.model
    if m.window_size is None:
        _require(
            not m.window_attn_skip_freq,
            f"model.window_attn_skip_freq={m.window_attn_skip_freq!r} needs model.window_size (it picks the windowed blocks)",
        )
        return
    window = m.window_size
    _require(len(window) == 2, f"model.window_size={window} must be two numbers [left, right] (e.g. [128, 0])")
    _require(window[0] >= -1, f"model.window_size={window}: left must be >= 0, or -1 for unbounded")
    _require(
        window[1] == 0,
        f"model.window_size={window}: right must be 0 (GPT attention is causal: a query sees no later key)",
    )
    _require(
        not m.mtp_num_layers,
        f"model.window_size={window} with model.mtp_num_layers={m.mtp_num_layers}: which window the prediction "
        "modules' blocks take is not built; unset one",
    )
    if m.window_attn_skip_freq:
        try:
            layer_pattern(m.window_attn_skip_freq, m.num_layers, "model.window_attn_skip_freq", from_one=True)
        except ValueError as e:
            _require(False, str(e))
