"""The Hugging Face Llama layout (LlamaForCausalLM), to and from dtgpt names.

- dtgpt's fused QKV rows, [group, (q_1 .. q_{nh/ng} | k | v), head_dim], are split into
  q_proj (nh heads), k_proj and v_proj (ng heads each), heads in order: Llama's query head i
  reads key/value head i // (nh / ng), as dtgpt's does.
- The SwiGLU MLP: gate -> gate_proj (SiLU), fc1 -> up_proj, fc2 -> down_proj.
- RoPE: Llama rotates channel i with channel i + d/2 over the whole head (its rotate_half):
  dtgpt's rotary_interleaved=false, rotary_percent=1. Interleaved pairs (2i, 2i+1) are written
  with each q and k head's rows reordered (evens, then odds), which gives the same attention
  (as transformers' own conversion of Meta's Llama weights does). `use_rope_scaling` is Llama 3.1's
  `rope_scaling` {rope_type: llama3, low_freq_factor 1, high_freq_factor 4,
  original_max_position_embeddings 8192}, the only scaling dtgpt has.
- Biases: Llama's attention_bias puts one on q, k, v and o_proj, mlp_bias on the three MLP
  matrices. dtgpt's add_qkv_bias alone is written with a zero o_proj bias. On import,
  attention_bias with a zero o_proj bias and no mlp_bias reads as add_qkv_bias; any other
  bias as add_bias_linear, with zeros where Llama has none.
config.json carries the legacy `rope_theta` / `rope_scaling` keys that every transformers
version reads; `rope_parameters` (what transformers 5 writes) is read too.
"""

from __future__ import annotations

import torch

from dtgpt.checkpoint.hf_files import (
    HFLayout, Named, Tensors, bias_or_zeros, plain_architecture, rope_keys, top_from_hf, top_to_hf, unmet,
)  # fmt: skip
from dtgpt.config import ModelConfig
from dtgpt.config.attention_keys import VARIANTS_OFF
from dtgpt.model import WORD_EMBEDDING

LM_HEAD = "lm_head.weight"
# Llama 3.1's frequency bands, as dtgpt.model.rotary_frequencies fixes them.
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_TOP = {WORD_EMBEDDING: "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_BLOCK = {
    "input_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attention.proj.weight": "self_attn.o_proj.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.fc1.weight": "mlp.up_proj.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
}
_MLP_BIASES = {"mlp.gate.bias": "mlp.gate_proj.bias", "mlp.fc1.bias": "mlp.up_proj.bias", "mlp.fc2.bias": "mlp.down_proj.bias"}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def llama_problems(m: ModelConfig) -> list[str]:
    wanted = {"normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True, "qk_layernorm": False,
              "rotary_percent": 1.0, "multi_latent_attention": False, **VARIANTS_OFF}  # fmt: skip
    problems = unmet(m, wanted)
    if m.hidden_size % m.num_attention_heads:  # LlamaConfig refuses it, whatever head_dim says
        problems.append(f"model.num_attention_heads dividing model.hidden_size (the config has {m.num_attention_heads} and {m.hidden_size})")
    return problems


def _check(m: ModelConfig) -> None:
    problems = llama_problems(m)
    if problems:
        raise ValueError("LlamaForCausalLM needs " + ", ".join(problems))


def _split_qkv(t: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [group, (q_1..q_{nh/ng} | k | v), hd] -> q (nh*hd rows), k, v (ng*hd rows each)."""
    ng, per = m.query_groups, m.num_attention_heads // m.query_groups
    grouped = t.reshape(ng, per + 2, m.head_dim, *t.shape[1:])
    q, k, v = (x.reshape(-1, *t.shape[1:]) for x in (grouped[:, :per], grouped[:, per], grouped[:, per + 1]))
    if m.rotary_interleaved:
        q, k = _pairs_to_halves(q, m.head_dim), _pairs_to_halves(k, m.head_dim)
    return q, k, v


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    if m.rotary_interleaved:
        q, k = _halves_to_pairs(q, m.head_dim), _halves_to_pairs(k, m.head_dim)
    ng, hd, rest = m.query_groups, m.head_dim, q.shape[1:]
    grouped = torch.cat([q.reshape(ng, -1, hd, *rest), k.reshape(ng, 1, hd, *rest), v.reshape(ng, 1, hd, *rest)], dim=1)
    return grouped.reshape(-1, *rest)


def _pairs_to_halves(t: torch.Tensor, hd: int) -> torch.Tensor:
    """Each head's rows reordered 0, 2, 4, ..., 1, 3, 5, ...: interleaved RoPE's pair (2i, 2i+1)
    becomes Llama's (i, i + d/2), rotated by the same angle; q.k is unchanged, q and k moving alike."""
    return t.reshape(-1, hd // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _halves_to_pairs(t: torch.Tensor, hd: int) -> torch.Tensor:
    return t.reshape(-1, 2, hd // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def to_llama(model: Tensors, m: ModelConfig) -> Tensors:
    """dtgpt model state (full tensors, tied head stored once) -> Llama tensors."""
    _check(m)
    out = top_to_hf(model, _TOP, LM_HEAD, m)
    qkv_size = (m.num_attention_heads + 2 * m.query_groups) * m.head_dim
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out.update({dst + hf: model[src + ours] for ours, hf in _BLOCK.items()})
        weights = _split_qkv(model[src + "attention.qkv.weight"], m)
        out.update({f"{dst}{name}.weight": w for name, w in zip(_QKV, weights)})
        if m.qkv_bias:
            biases = _split_qkv(bias_or_zeros(model, src + "attention.qkv.bias", qkv_size), m)
            out.update({f"{dst}{name}.bias": b for name, b in zip(_QKV, biases)})
            out[dst + "self_attn.o_proj.bias"] = bias_or_zeros(model, src + "attention.proj.bias", m.hidden_size)
        if m.add_bias_linear:
            out.update({dst + hf: model[src + ours] for ours, hf in _MLP_BIASES.items()})
    return {k: v.contiguous() for k, v in out.items()}


def from_llama(tensors: Tensors, m: ModelConfig, vocab_size: int) -> Tensors:
    """Llama tensors -> dtgpt model state; the word embedding is zero-padded to `vocab_size` rows."""
    _check(m)
    hf = Named(tensors, "Llama")
    model = top_from_hf(hf, _TOP, LM_HEAD, m, vocab_size)
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        model.update({dst + ours: hf[src + name] for ours, name in _BLOCK.items()})
        model[dst + "attention.qkv.weight"] = _join_qkv(*(hf[f"{src}{name}.weight"] for name in _QKV), m)
        if m.qkv_bias:
            sizes = [n * m.head_dim for n in (m.num_attention_heads, m.query_groups, m.query_groups)]
            biases = (bias_or_zeros(hf, f"{src}{name}.bias", n) for name, n in zip(_QKV, sizes))
            model[dst + "attention.qkv.bias"] = _join_qkv(*biases, m)
        if m.add_bias_linear:
            model[dst + "attention.proj.bias"] = bias_or_zeros(hf, src + "self_attn.o_proj.bias", m.hidden_size)
            sizes = {"mlp.gate.bias": m.ffn_size, "mlp.fc1.bias": m.ffn_size, "mlp.fc2.bias": m.hidden_size}
            model.update({dst + ours: bias_or_zeros(hf, src + name, sizes[ours]) for ours, name in _MLP_BIASES.items()})
    return {k: v.contiguous() for k, v in model.items()}


def llama_config(m: ModelConfig, vocab_size: int, eod: int) -> dict:
    """config.json; both special-token ids are the tokenizer's eod."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.query_groups, "head_dim": m.head_dim,
        "hidden_act": "silu", "max_position_embeddings": m.max_positions, "initializer_range": m.init_method_std,
        "rms_norm_eps": m.norm_epsilon, "rope_theta": float(m.rotary_base), "attention_bias": m.qkv_bias,
        "attention_dropout": m.attention_dropout, "mlp_bias": m.add_bias_linear,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "torch_dtype": "float32",
        "bos_token_id": eod, "eos_token_id": eod,
    }  # fmt: skip
    if m.use_rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": m.rope_scaling_factor, **LLAMA3_SCALING}
    return config


def llama_overrides(config: dict, tensors: Tensors, source: str) -> dict:
    """The [model] architecture a Llama config.json (read from `source`) and its tensors describe."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={config['hidden_act']!r} is not 'silu' (dtgpt's SwiGLU)")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    o_proj_zero = all(not t.any() for k, t in tensors.items() if k.endswith("self_attn.o_proj.bias"))
    bias_linear = mlp_bias or (attention_bias and not o_proj_zero)
    return {
        **plain_architecture(), **_rope(config, source), "num_layers": config["num_hidden_layers"],
        "hidden_size": hidden, "num_attention_heads": heads, "group_query_attention": groups != heads,
        "num_query_groups": groups if groups != heads else 1, "kv_channels": 0 if head_dim * heads == hidden else head_dim,
        "ffn_hidden_size": config["intermediate_size"], "swiglu": True, "add_bias_linear": bias_linear,
        "add_qkv_bias": attention_bias and not bias_linear, "normalization": "RMSNorm",
        "norm_epsilon": config.get("rms_norm_eps", 1e-6), "position_embedding_type": "rope",
        "max_position_embeddings": config.get("max_position_embeddings", 2048),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
    }  # fmt: skip


def _rope(config: dict, source: str) -> dict:
    """rotary_base and the scaling of config.json's rope keys (legacy or transformers 5's)."""
    parameters, scaling, theta = rope_keys(config, source)
    partial = config.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial}: LlamaForCausalLM rotates whole heads")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {"rotary_base": int(theta)}
    if kind != "llama3":
        raise ValueError(f"{source}: rope_type={kind!r} is not one dtgpt has ('default', or 'llama3': model.use_rope_scaling)")
    for key, value in LLAMA3_SCALING.items():
        if scaling.get(key) != value:
            raise ValueError(f"{source}: rope_scaling {key}={scaling.get(key)} is not {value}, the Llama 3.1 scaling of model.use_rope_scaling")
    return {"rotary_base": int(theta), "use_rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


LAYOUT = HFLayout("LlamaForCausalLM", "llama", llama_problems, to_llama, from_llama, llama_config, llama_overrides)
