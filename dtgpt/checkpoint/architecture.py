"""A checkpoint's model architecture, compared with the config's before any tensor is read.

Shapes alone do not tell a RoPE convention, a GeLU variant or a gamma stored as gamma - 1
apart, so loading compares the architecture the checkpoint was saved with (a dtgpt
checkpoint's config.toml, a Megatron-LM checkpoint's `args` in common.pt) with `[model]`, and
refuses a difference in one line naming the key. Each `[model]` key is named as Megatron-LM's
argument, so its args map one to one; `architecture` gives the effective values either way
(Megatron fills kv_channels, the query groups and the GeLU variant in from other arguments).
`checkpoint.use_checkpoint_args` takes the checkpoint's architecture instead (Megatron-LM's
--use-checkpoint-args).
"""

from __future__ import annotations

import dataclasses

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.config import Config, ModelConfig
from dtgpt.config.layer_freq import moe_layer_pattern

MOE_FIELDS = (
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
)  # fmt: skip
"""The mixture-of-experts keys that change the model's tensors or what it computes from them
(the losses' coefficients, capacity and the bias's update rate are training settings)."""

OPTIONAL_SIZES = ("moe_shared_expert_intermediate_size",)
"""MoE keys whose None is a setting (no shared expert), compared as such; other None values
are keys the args lack, not compared."""

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
              "rotary_scaling_factor", "mscale", "mscale_all_dim")  # fmt: skip
"""Multi-latent attention's keys that Megatron-LM keeps in its args, compared where both sides
have it (rope_type as its effective value: unset is YaRN there)."""

VARIANTS = {"window_size": None, "window_attn_skip_freq": None, "softmax_type": "vanilla", "glu_linear_offset": 0.0,
            "activation_func_clamp_value": None, "qk_l2_norm": False, "no_rope_freq": None}  # fmt: skip
"""Sliding windows, sinks, SwiGLU's clamp and Llama 4's options, with Megatron's defaults: args that
lack one (from before the flag) are that default. Always compared, window_attn_skip_freq and
no_rope_freq as their per-block patterns."""

FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups", "kv_channels",
    "ffn_hidden_size", "swiglu", "squared_relu", "openai_gelu", "bias_gelu_fusion", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "apply_layernorm_1p", "normalization", "norm_epsilon", "position_embedding_type", "max_position_embeddings",
    "rotary_base", "rotary_interleaved", "rotary_percent", "use_rope_scaling", "rope_scaling_factor",
    "untie_embeddings_and_output_weights", *MOE_FIELDS, "multi_latent_attention", *MLA_FIELDS, "mtp_num_layers", *VARIANTS,
)  # fmt: skip
"""The [model] fields that make the architecture (use_checkpoint_args takes these)."""

ROPE_KEYS = ("rotary_interleaved", "rotary_percent", "rotary_base", "use_rope_scaling", "rope_scaling_factor")
"""Compared only where both sides use RoPE."""


def architecture(m: ModelConfig) -> dict[str, object]:
    """The effective architecture of `m`, by Megatron-LM argument name."""
    arch: dict[str, object] = {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.query_groups, "kv_channels": m.head_dim, "ffn_hidden_size": m.ffn_size,
        "swiglu": m.swiglu, "add_bias_linear": m.add_bias_linear, "add_qkv_bias": m.qkv_bias,
        "normalization": m.normalization, "apply_layernorm_1p": m.apply_layernorm_1p, "qk_layernorm": m.qk_layernorm,
        "norm_epsilon": m.norm_epsilon, "position_embedding_type": m.position_embedding_type,
        "untie_embeddings_and_output_weights": m.untie_embeddings_and_output_weights,
        "multi_latent_attention": m.multi_latent_attention,
    }  # fmt: skip
    if m.mtp_num_layers:
        arch["mtp_num_layers"] = m.mtp_num_layers
    arch |= {key: getattr(m, key) for key in VARIANTS} | {"window_size": list(m.window_size) if m.window_size else None}
    arch["window_attn_skip_freq"] = [int(m.attention_window(i) is not None) for i in range(m.num_layers)] if m.window_size else None
    arch["no_rope_freq"] = [int(m.skips_rope(i)) for i in range(m.num_layers)] if m.no_rope_freq else None
    if m.multi_latent_attention:
        arch |= {key: getattr(m, key) for key in MLA_FIELDS} | {"rope_type": m.rope_type or "yarn"}
    arch["squared_relu"] = m.squared_relu  # a checkpoint saved before the key has none: not compared
    if not m.swiglu and not m.squared_relu:
        arch["gelu"] = m.gelu_approximation
    if m.position_embedding_type == "rope":
        arch |= {key: getattr(m, key) for key in ROPE_KEYS}
    if m.moe_enabled:
        moe = {key: getattr(m, key) for key in MOE_FIELDS} | {"moe_ffn_hidden_size": m.expert_ffn_size,
                                                              "moe_layer_freq": _layer_freq(m)}  # fmt: skip
        arch |= {key: value for key, value in moe.items() if value is not None or key in OPTIONAL_SIZES}
    return arch


def _layer_freq(m: ModelConfig) -> int | list[int]:
    """moe_layer_freq as Megatron-LM's args hold it: an int, or its list expression evaluated."""
    if isinstance(m.moe_layer_freq, int) or m.moe_layer_freq.strip().isdigit():
        return int(m.moe_layer_freq)
    return [int(moe) for moe in moe_layer_pattern(m.moe_layer_freq, m.num_layers)]


def _megatron_moe(args) -> dict[str, object]:
    """The MoE part of Megatron-LM's args (nothing for a dense model). validate_args fills
    moe_ffn_hidden_size in from ffn_hidden_size; args lacking it get the same."""
    if not getattr(args, "num_experts", None):
        return {}
    moe = {key: getattr(args, key, None) for key in MOE_FIELDS}
    moe["moe_ffn_hidden_size"] = moe["moe_ffn_hidden_size"] or getattr(args, "ffn_hidden_size", None)
    if moe["moe_layer_freq"] is not None and not isinstance(moe["moe_layer_freq"], int):
        moe["moe_layer_freq"] = list(moe["moe_layer_freq"])  # a per-layer pattern: never equal to an int
    return {key: value for key, value in moe.items() if value is not None or key in OPTIONAL_SIZES}


def megatron_architecture(args) -> dict[str, object]:
    """The effective architecture Megatron-LM's args describe, for the keys they hold (older
    Megatron versions store fewer; a key they lack is not compared)."""
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    names = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "swiglu", "add_bias_linear",
             "normalization", "apply_layernorm_1p", "qk_layernorm", "position_embedding_type",
             "untie_embeddings_and_output_weights", "multi_latent_attention", "mtp_num_layers")  # fmt: skip
    arch = {key: get(key) for key in names}
    arch["multi_latent_attention"] = bool(get("multi_latent_attention", False))  # args from before the flag: none
    latent = {}
    if arch["multi_latent_attention"]:  # q_lora_rank unset is a setting (the query projected in one): kept
        latent = {key: get(key) for key in MLA_FIELDS if hasattr(args, key)} | {"rope_type": get("rope_type") or "yarn"}
    arch["norm_epsilon"] = get("norm_epsilon", get("layernorm_epsilon"))
    heads, hidden = arch["num_attention_heads"], arch["hidden_size"]
    if heads:
        arch["num_query_groups"] = get("num_query_groups") if get("group_query_attention") else heads
        arch["kv_channels"] = get("kv_channels") or (hidden // heads if hidden else None)
    bias = arch["add_bias_linear"]
    if bias is not None:
        arch["add_qkv_bias"] = bool(bias or get("add_qkv_bias", False))
        arch["squared_relu"] = bool(get("squared_relu", False))
        if not arch["swiglu"] and not arch["squared_relu"]:  # Megatron's fused bias-GeLU (needs biases) and openai_gelu are tanh
            arch["gelu"] = "tanh" if get("openai_gelu", False) or (get("bias_gelu_fusion", True) and bias) else "none"
    if arch["position_embedding_type"] == "rope":
        arch |= {key: get(key) for key in ROPE_KEYS}
    return {key: value for key, value in arch.items() if value is not None} | latent | _megatron_moe(args) | _megatron_variants(args)


def _megatron_variants(args) -> dict[str, object]:
    """VARIANTS from Megatron-LM's args, window_attn_skip_freq as architecture() gives it."""
    variants = {key: getattr(args, key, default) for key, default in VARIANTS.items()}
    window, freq = variants["window_size"], variants["window_attn_skip_freq"]
    variants["window_size"] = list(window) if window else None
    if window:
        pattern = ModelConfig(num_layers=args.num_layers, window_size=list(window), window_attn_skip_freq=str(freq) if freq else 0)
        variants["window_attn_skip_freq"] = [int(pattern.attention_window(i) is not None) for i in range(args.num_layers)]
    nope = variants["no_rope_freq"]  # an int or the list validate_args expands it to
    if nope:
        pattern = ModelConfig(num_layers=args.num_layers, no_rope_freq=str(nope))
        variants["no_rope_freq"] = [int(pattern.skips_rope(i)) for i in range(args.num_layers)]
    return variants


SETTINGS = {
    "num_query_groups": "model.group_query_attention=true and model.num_query_groups={value}",
    "kv_channels": "model.kv_channels={value}",
    "gelu": "model.bias_gelu_fusion={fused} (and model.openai_gelu=false) for the {value} GeLU",
}
"""How to set a derived key in [model]; the others are set as they are named."""


def difference(stored: dict[str, object], m: ModelConfig) -> str | None:
    """The first architecture key on which `stored` (see architecture) and `m` differ, as a
    sentence naming both values and the setting that takes the checkpoint's; None if none."""
    ours = architecture(m)
    if "num_layers" in stored and "num_experts" in ours and "num_experts" not in stored:
        stored = {**stored, "num_experts": None}  # a dense model's architecture names no MoE key
    for key, value in stored.items():
        if key in ("num_experts", "mtp_num_layers") and key not in ours:  # unset in the config
            ours = {**ours, key: None}
        if key in ours and not _equal(ours[key], value):
            setting = SETTINGS.get(key, "model.{key}={value}").format(key=key, value=_toml(value), fused=_toml(value == "tanh"))
            if value is None:  # a dense checkpoint: the MoE key unset
                setting = f"no model.{key}"
            return (
                f"model.{key}: the checkpoint has {_toml(value)} but the config has {_toml(ours[key])}; "
                f"set {setting}, or checkpoint.use_checkpoint_args=true to take the checkpoint's architecture"
            )
    return None


def require_same(stored: dict[str, object], m: ModelConfig, where: str) -> None:
    """CheckpointError(where: difference) if the architectures differ."""
    problem = difference(stored, m)
    if problem:
        raise CheckpointError(f"{where}: {problem}")


def with_megatron_architecture(args, m: ModelConfig) -> ModelConfig:
    """`m` with the architecture Megatron-LM's args describe (checkpoint.use_checkpoint_args)."""
    stored = megatron_architecture(args)
    changes = {key: stored[key] for key in FIELDS if key in stored and key not in ("num_query_groups", "kv_channels", "add_qkv_bias")}
    if isinstance(changes.get("moe_layer_freq"), list):
        changes["moe_layer_freq"] = str(changes["moe_layer_freq"])  # [model]'s list expression
    for key in ("window_attn_skip_freq", "no_rope_freq"):  # a per-block pattern: [model]'s list expression
        changes[key] = str(stored[key]) if stored.get(key) else 0
    if "num_layers" in stored and "num_experts" not in stored:
        changes["num_experts"] = None  # a dense checkpoint
    if "num_query_groups" in stored:
        grouped = stored["num_query_groups"] != stored["num_attention_heads"]
        changes |= {"group_query_attention": grouped, "num_query_groups": stored["num_query_groups"] if grouped else 1}
        changes["kv_channels"] = 0 if stored["kv_channels"] * stored["num_attention_heads"] == stored["hidden_size"] else stored["kv_channels"]
    if "add_qkv_bias" in stored:
        changes["add_qkv_bias"] = stored["add_qkv_bias"] and not stored["add_bias_linear"]
    if "gelu" in stored:
        tanh = stored["gelu"] == "tanh"
        # dtgpt's tanh GeLU without biases is openai_gelu (Megatron's fused one needs biases)
        changes |= {"bias_gelu_fusion": tanh, "openai_gelu": tanh and not stored["add_bias_linear"]}
    for key in ("max_position_embeddings",):
        if getattr(args, key, None):
            changes[key] = getattr(args, key)
    return dataclasses.replace(m, **changes)


def with_architecture_of(saved: ModelConfig, m: ModelConfig) -> ModelConfig:
    """`m` with the architecture fields of a dtgpt checkpoint's saved [model]."""
    return dataclasses.replace(m, **{key: getattr(saved, key) for key in FIELDS})


def megatron_args(m: ModelConfig) -> dict[str, object]:
    """The architecture as Megatron-LM's own args (what `to-megatron` writes into common.pt)."""
    args = {key: getattr(m, key) for key in FIELDS}
    args |= {
        "ffn_hidden_size": m.ffn_size, "kv_channels": m.head_dim, "num_query_groups": m.query_groups,
        "add_qkv_bias": m.qkv_bias, "bias_gelu_fusion": m.bias_gelu_fusion and m.add_bias_linear,
        "max_position_embeddings": m.max_positions, "seq_length": m.seq_length,
        "moe_ffn_hidden_size": m.expert_ffn_size if m.moe_enabled else None,  # filled in, as Megatron's validate_args does
        "moe_layer_freq": _layer_freq(m),
        "window_size": tuple(m.window_size) if m.window_size else None, "window_attn_skip_freq": m.window_attn_skip_freq or None,
        "no_rope_freq": m.no_rope_freq or None,
    }  # fmt: skip
    return args


def _equal(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b  # True and 1 are different settings
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _toml(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return f"'{value}'" if isinstance(value, str) else str(value)


def saved_difference(saved: Config | None, cfg: Config) -> str | None:
    """difference() between a dtgpt checkpoint's saved config (None: it has none) and the run's."""
    return difference(architecture(saved.model), cfg.model) if saved is not None else None
