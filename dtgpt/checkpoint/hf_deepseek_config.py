"""DeepseekV3ForCausalLM's config.json, to and from dtgpt's [model] keys, and what a dtgpt model
must be for that class to hold it (the tensors: hf_deepseek.py).

What the class computes and so what it needs of a dtgpt model:
- multi-latent attention with norms on both compressed vectors (model.qk_layernorm), no biases,
  RMSNorm and SwiGLU everywhere. Its q_a_layernorm and kv_a_layernorm always use eps 1e-6
  (rms_norm_eps reaches only the other norms), so model.norm_epsilon must be 1e-6.
- RoPE on the qk_rope_head_dim channels in interleaved pairs (`rope_interleave`): the same
  rotation as dtgpt's de-interleave-then-rotate-halves, channel for channel, so no row moves.
  YaRN is `rope_scaling` {type yarn, factor, mscale, mscale_all_dim, original_max_position_embeddings,
  beta_fast, beta_slow}; transformers infers the cos/sin factor from mscale and mscale_all_dim
  only when both are non-zero, so `attention_factor` is written where its inference would
  differ from dtgpt's. The softmax scale takes mscale(factor, mscale_all_dim)^2 as dtgpt's does.
- the first `first_k_dense_replace` blocks dense, the rest MoE (moe_layer_freq's list form
  [0]*k + [1]*(L-k), or an int that gives that pattern), every MoE block with experts of one
  width and `n_shared_experts` shared ones of that width (model.moe_shared_expert_intermediate_size
  a multiple of it), dropless.
- sigmoid routing, the top-k chosen on scores + `e_score_correction_bias` (dtgpt's expert bias;
  zeros where the model has none), weighted by the unbiased scores, normalised when top-k > 1
  (`norm_topk_prob`, as dtgpt always does then), times `routed_scaling_factor`. Group-limited
  routing scores a group by its top 2 experts: moe_router_topk / moe_router_group_topk must be 2
  (no groups: n_group = topk_group = 1).
- `num_nextn_predict_layers` prediction modules, stored as DeepSeek publishes them (layers
  num_hidden_layers + k; transformers' model ignores them).
DeepSeek's own config.json also names `scoring_func`, `topk_method` and `moe_layer_freq`, which
transformers' class fixes: they are written as it computes, and read only where they agree.
"""

from __future__ import annotations

import math

from dtgpt.checkpoint.hf_checks import config_value
from dtgpt.checkpoint.hf_files import need, plain_architecture, rope_keys, unmet
from dtgpt.config import ModelConfig
from dtgpt.config.attention_keys import VARIANTS_OFF
from dtgpt.config.layer_freq import moe_layer_pattern
from dtgpt.rope import yarn_mscale

ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6
"""The eps of transformers' q_a_layernorm and kv_a_layernorm, fixed whatever rms_norm_eps says."""
GROUP_SCORE_EXPERTS = 2
"""transformers scores an expert group by the sum of its top 2 scores."""
YARN_KEYS = ("original_max_position_embeddings", "beta_fast", "beta_slow")


def dense_blocks(m: ModelConfig) -> int | None:
    """How many blocks come first and dense when the rest (at least one) are MoE (None: another pattern)."""
    pattern = moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    k = pattern.index(True) if True in pattern else m.num_layers
    return k if k < m.num_layers and all(pattern[k:]) else None


def shared_experts(m: ModelConfig) -> int | None:
    """The shared MLP's width in experts (None: not a whole number of them)."""
    shared, width = m.moe_shared_expert_intermediate_size, m.expert_ffn_size
    return shared // width if shared and shared % width == 0 else None


def deepseek_problems(m: ModelConfig) -> list[str]:
    wanted = {"multi_latent_attention": True, "qk_layernorm": True, "normalization": "RMSNorm", "swiglu": True,
              "add_bias_linear": False, "norm_epsilon": LATENT_NORM_EPS, **VARIANTS_OFF}  # fmt: skip
    problems = unmet(m, wanted)
    if not m.moe_enabled:
        return problems + [need("num_experts", "a count", m)]
    problems += unmet(m, {"moe_router_score_function": "sigmoid", "moe_expert_capacity_factor": None, "moe_shared_expert_gate": False})
    if dense_blocks(m) is None:
        problems.append(need("moe_layer_freq", "dense blocks first, then MoE blocks ([0]*k+[1]*rest)", m))
    if shared_experts(m) is None:
        problems.append(need("moe_shared_expert_intermediate_size", f"a multiple of the expert width {m.expert_ffn_size}", m))
    if m.moe_router_group_topk and m.moe_router_topk != GROUP_SCORE_EXPERTS * m.moe_router_group_topk:
        problems.append(need("moe_router_topk", GROUP_SCORE_EXPERTS * m.moe_router_group_topk, m)
                        + f" with model.moe_router_group_topk={m.moe_router_group_topk}: its groups are scored by their top 2 experts")  # fmt: skip
    if not m.moe_router_group_topk and m.num_experts < GROUP_SCORE_EXPERTS:
        problems.append(need("num_experts", f">= {GROUP_SCORE_EXPERTS}", m))
    if not m.yarn and yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim) != 1.0:
        problems.append(need("mscale_all_dim", 0.0, m) + " without YaRN (model.rope_type='rope' scales no softmax there)")
    return problems


def _attention_factor(m: ModelConfig) -> float:
    return yarn_mscale(m.rotary_scaling_factor, m.mscale) / yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim)


def _inferred_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The cos/sin factor transformers infers from rope_scaling without an attention_factor."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def deepseek_config(m: ModelConfig, vocab_size: int, eod: int) -> dict:
    """config.json; both special-token ids are the tokenizer's eod."""
    grouped = bool(m.moe_router_group_topk)
    config = {
        "architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "vocab_size": vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size, "moe_intermediate_size": m.expert_ffn_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads, "n_shared_experts": shared_experts(m),
        "n_routed_experts": m.num_experts, "routed_scaling_factor": m.moe_router_topk_scaling_factor or 1.0,
        "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank, "qk_rope_head_dim": m.qk_pos_emb_head_dim,
        "qk_nope_head_dim": m.qk_head_dim, "v_head_dim": m.v_head_dim,
        "n_group": m.moe_router_num_groups if grouped else 1, "topk_group": m.moe_router_group_topk if grouped else 1,
        "num_experts_per_tok": m.moe_router_topk, "first_k_dense_replace": dense_blocks(m),
        "norm_topk_prob": m.moe_router_topk > 1, "hidden_act": "silu", "max_position_embeddings": m.max_positions,
        "initializer_range": m.init_method_std, "rms_norm_eps": m.norm_epsilon, "rope_theta": float(m.rotary_base),
        "rope_interleave": True, "attention_bias": False, "attention_dropout": m.attention_dropout,
        "num_nextn_predict_layers": m.mtp_depth, "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "torch_dtype": "float32", "bos_token_id": eod, "eos_token_id": eod,
        # DeepSeek's own keys, which transformers' class fixes but other readers of its checkpoints
        # take from config.json (their defaults are DeepSeek-V2's softmax routing)
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    }  # fmt: skip
    if m.yarn:
        scaling = {"rope_type": "yarn", "factor": m.rotary_scaling_factor, "mscale": m.mscale, "mscale_all_dim": m.mscale_all_dim,
                   **{key: getattr(m, key) for key in YARN_KEYS}}  # fmt: skip
        if _inferred_attention_factor(m.rotary_scaling_factor, m.mscale, m.mscale_all_dim) != _attention_factor(m):
            scaling["attention_factor"] = _attention_factor(m)
        config["rope_scaling"] = scaling
    return config


def deepseek_overrides(config: dict, tensors: dict, source: str) -> dict:
    """The [model] architecture a DeepseekV3 config.json (read from `source`) and its tensors describe."""

    def value(key, default=None):
        return config_value(config, key, source, default)

    def refuse(key, why: str):
        raise ValueError(f"{source}: {key}={config.get(key)!r} {why}")

    if value("hidden_act", "silu") != "silu":
        refuse("hidden_act", "is not 'silu' (dtgpt's SwiGLU)")
    # keys of DeepSeek's own config.json that transformers' class does not read, but fixes
    for key, wanted, rule in (("scoring_func", "sigmoid", "the router's score function"),
                              ("topk_method", "noaux_tc", "the top-k on the biased scores, groups scored by their top 2"),
                              ("moe_layer_freq", 1, "every block after the dense ones MoE")):  # fmt: skip
        if config.get(key, wanted) != wanted:
            refuse(key, f"is not {wanted!r} ({rule}, what DeepseekV3ForCausalLM and dtgpt compute)")
    if value("attention_bias", False) is not False:
        refuse("attention_bias", "is not false: dtgpt's multi-latent attention has no bias on its projections")
    if value("rope_interleave", True) is not True:
        refuse("rope_interleave", "is not true: dtgpt's multi-latent attention rotates interleaved pairs, as DeepSeek-V3")
    layers, heads = value("num_hidden_layers"), value("num_attention_heads")
    if value("num_key_value_heads", heads) != heads:
        refuse("num_key_value_heads", f"is not num_attention_heads={heads}: multi-latent attention has no key/value groups")
    if value("rms_norm_eps", LATENT_NORM_EPS) != LATENT_NORM_EPS:
        refuse("rms_norm_eps", f"is not {LATENT_NORM_EPS}: its q_a_layernorm and kv_a_layernorm use {LATENT_NORM_EPS} and "
                               "dtgpt's model.norm_epsilon is one for every norm")  # fmt: skip
    experts, k, width = value("n_routed_experts"), value("num_experts_per_tok"), value("moe_intermediate_size")
    first = min(value("first_k_dense_replace", 0), layers)
    if first >= layers:
        refuse("first_k_dense_replace", f"leaves no MoE block of num_hidden_layers={layers}: dtgpt reads DeepSeek-V3 models with MoE blocks")
    if value("norm_topk_prob", True) is not (k > 1):
        refuse("norm_topk_prob", f"with num_experts_per_tok={k}: dtgpt's sigmoid router normalises the weights exactly when top-k > 1")
    shared = value("n_shared_experts", 1)
    if shared < 1:
        refuse("n_shared_experts", "is not >= 1: dtgpt reads DeepSeek-V3 MoE blocks with shared experts only")
    groups, group_topk = value("n_group", 1), value("topk_group", 1)
    if group_topk < groups and k != GROUP_SCORE_EXPERTS * group_topk:
        refuse("num_experts_per_tok", f"is not {GROUP_SCORE_EXPERTS} x topk_group={group_topk}: transformers scores a group by its "
                                      "top 2 experts, dtgpt by its top num_experts_per_tok / topk_group")  # fmt: skip
    scaling = value("routed_scaling_factor", 1.0)
    return {
        **plain_architecture(), **_rope(config, source), "num_layers": layers, "hidden_size": value("hidden_size"),
        "num_attention_heads": heads, "ffn_hidden_size": value("intermediate_size"), "swiglu": True,
        "add_bias_linear": False, "normalization": "RMSNorm", "norm_epsilon": LATENT_NORM_EPS, "qk_layernorm": True,
        "position_embedding_type": "rope", "max_position_embeddings": value("max_position_embeddings", 4096),
        "untie_embeddings_and_output_weights": not value("tie_word_embeddings", False), "multi_latent_attention": True,
        "q_lora_rank": config.get("q_lora_rank"), "kv_lora_rank": value("kv_lora_rank"), "qk_head_dim": value("qk_nope_head_dim"),
        "qk_pos_emb_head_dim": value("qk_rope_head_dim"), "v_head_dim": value("v_head_dim"),
        "num_experts": experts, "moe_ffn_hidden_size": width, "moe_router_topk": k,
        "moe_layer_freq": f"([0]*{first}+[1]*{layers - first})", "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "moe_shared_expert_intermediate_size": shared * width,
        "moe_router_num_groups": groups if group_topk < groups else None,
        "moe_router_group_topk": group_topk if group_topk < groups else None,
        "moe_router_topk_scaling_factor": None if scaling == 1.0 else float(scaling),
        "mtp_num_layers": _prediction_layers(config, tensors, layers) or None,
    }  # fmt: skip


def _prediction_layers(config: dict, tensors: dict, layers: int) -> int:
    """The prediction modules the weights hold (a directory transformers saved names one in
    num_nextn_predict_layers but holds none)."""
    named = config.get("num_nextn_predict_layers") or 0
    return next((k for k in range(named) if f"model.layers.{layers + k}.eh_proj.weight" not in tensors), named)


def _rope(config: dict, source: str) -> dict:
    """rotary_base and YaRN's keys from config.json's rope keys (legacy or transformers 5's)."""
    _, scaling, theta = rope_keys(config, source)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {"rotary_base": int(theta), "rope_type": "rope"}
    if kind != "yarn":
        raise ValueError(f"{source}: rope_type={kind!r} is not one dtgpt's multi-latent attention has ('default' or 'yarn')")
    for key, wanted in (("partial_rotary_factor", 1.0), ("truncate", True)):
        if scaling.get(key, wanted) != wanted:
            raise ValueError(f"{source}: rope_scaling {key}={scaling[key]!r} is not {wanted!r}, the YaRN dtgpt computes")
    context = scaling.get("original_max_position_embeddings") or 4096
    factor = scaling.get("factor") or config.get("max_position_embeddings", 4096) / context
    mscale, mscale_all_dim = scaling.get("mscale") or 0.0, scaling.get("mscale_all_dim") or 0.0
    ours = {"rotary_base": int(theta), "rope_type": "yarn", "rotary_scaling_factor": float(factor),
            "mscale": float(mscale or 1.0), "mscale_all_dim": float(mscale_all_dim), "original_max_position_embeddings": context,
            "beta_fast": float(scaling.get("beta_fast") or 32.0), "beta_slow": float(scaling.get("beta_slow") or 1.0)}  # fmt: skip
    theirs = scaling.get("attention_factor") or _inferred_attention_factor(factor, mscale, mscale_all_dim)
    wanted = yarn_mscale(factor, ours["mscale"]) / yarn_mscale(factor, mscale_all_dim)
    if not math.isclose(theirs, wanted, rel_tol=1e-12):
        raise ValueError(f"{source}: rope_scaling gives YaRN's cos/sin the factor {theirs}, not mscale(factor, mscale) / "
                         f"mscale(factor, mscale_all_dim) = {wanted} as dtgpt's model.mscale and model.mscale_all_dim do")  # fmt: skip
    return ours
