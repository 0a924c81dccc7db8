"""The Hugging Face GPT-2 layout (GPT2LMHeadModel), to and from dtgpt names.

Two layout differences matter besides the names:
- GPT-2 uses Conv1D, whose weight is (in_features, out_features): every matrix is transposed.
- dtgpt's fused QKV rows are grouped head by head, [head, (q|k|v), head_dim] (so a tp split of
  the rows gives whole heads), while GPT-2's c_attn columns are three blocks [q; k; v], each
  holding all heads in order.
GPT-2 has learned positions, LayerNorm, a GeLU MLP, one key/value head per query head and
biases everywhere; a bias-free dtgpt model is written with zero biases (the same function). The
tanh GeLU is GPT-2's "gelu_new", the exact one "gelu". An untied head is GPT-2's
`lm_head.weight` with `tie_word_embeddings: false`.
"""

from __future__ import annotations

import torch

from dtgpt.checkpoint.hf_files import HFLayout, Named, Tensors, bias_or_zeros, need, plain_architecture, top_from_hf, top_to_hf, unmet
from dtgpt.config import ModelConfig
from dtgpt.config.attention_keys import VARIANTS_OFF

PREFIX = "transformer."
LM_HEAD = "lm_head.weight"
# Both names are GPT-2's tanh approximation of GeLU; "gelu" is the exact (erf) one.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
GELU = {**{name: "tanh" for name in TANH_GELU}, "gelu": "none"}

# dtgpt block name -> GPT-2 block name; "T" marks Conv1D weights (transposed).
_BLOCK = {
    "input_norm.weight": ("ln_1.weight", False),
    "input_norm.bias": ("ln_1.bias", False),
    "attention.proj.weight": ("attn.c_proj.weight", True),
    "mlp_norm.weight": ("ln_2.weight", False),
    "mlp_norm.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True),
}
_BIASES = {"attention.proj.bias": "attn.c_proj.bias", "mlp.fc1.bias": "mlp.c_fc.bias", "mlp.fc2.bias": "mlp.c_proj.bias"}
_TOP = {
    "embedding.word.weight": "wte.weight",
    "embedding.position.weight": "wpe.weight",
    "norm.weight": "ln_f.weight",
    "norm.bias": "ln_f.bias",
}


def gpt2_problems(m: ModelConfig) -> list[str]:
    wanted = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False, "qk_layernorm": False,
              "multi_latent_attention": False, "squared_relu": False, **VARIANTS_OFF}  # fmt: skip
    problems = unmet(m, wanted)
    if m.query_groups != m.num_attention_heads:
        problems.append(need("group_query_attention", False, m))
    if m.head_dim * m.num_attention_heads != m.hidden_size:
        problems.append(need("kv_channels", 0, m))
    return problems


def _check(m: ModelConfig) -> None:
    problems = gpt2_problems(m)
    if problems:
        raise ValueError("GPT2LMHeadModel needs " + ", ".join(problems))


def _qkv_heads_to_blocks(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head, (q|k|v), hd] -> rows [(q|k|v), head, hd] (weight (3h, h) or bias (3h,))."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_blocks_to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def to_gpt2(model: Tensors, m: ModelConfig) -> Tensors:
    """dtgpt model state (full tensors, tied head stored once) -> GPT-2 tensors."""
    _check(m)
    heads, h = m.num_attention_heads, m.hidden_size
    out = top_to_hf(model, {ours: PREFIX + hf for ours, hf in _TOP.items()}, LM_HEAD, m)
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"{PREFIX}h.{i}."
        for ours, (hf, transpose) in _BLOCK.items():
            t = model[src + ours]
            out[dst + hf] = t.t() if transpose else t
        for ours, hf in _BIASES.items():
            out[dst + hf] = bias_or_zeros(model, src + ours, m.ffn_size if ours == "mlp.fc1.bias" else h)
        out[dst + "attn.c_attn.weight"] = _qkv_heads_to_blocks(model[src + "attention.qkv.weight"], heads).t()
        out[dst + "attn.c_attn.bias"] = _qkv_heads_to_blocks(bias_or_zeros(model, src + "attention.qkv.bias", 3 * h), heads)
    return {k: v.contiguous() for k, v in out.items()}


def from_gpt2(tensors: Tensors, m: ModelConfig, vocab_size: int) -> Tensors:
    """GPT-2 tensors -> dtgpt model state; the word embedding is zero-padded to `vocab_size` rows."""
    _check(m)
    hf = Named({(k[len(PREFIX):] if k.startswith(PREFIX) else k): v for k, v in tensors.items()}, "GPT-2")
    heads = m.num_attention_heads
    model = top_from_hf(hf, _TOP, LM_HEAD, m, vocab_size)
    for i in range(m.num_layers):
        src, dst = f"h.{i}.", f"layers.{i}."
        for ours, (name, transpose) in _BLOCK.items():
            t = hf[src + name]
            model[dst + ours] = t.t() if transpose else t
        model.update({dst + ours: hf[src + name] for ours, name in _BIASES.items()})
        model[dst + "attention.qkv.weight"] = _qkv_blocks_to_heads(hf[src + "attn.c_attn.weight"].t(), heads)
        model[dst + "attention.qkv.bias"] = _qkv_blocks_to_heads(hf[src + "attn.c_attn.bias"], heads)
    return {k: v.contiguous() for k, v in model.items()}


def gpt2_config(m: ModelConfig, vocab_size: int, eod: int) -> dict:
    """config.json; both special-token ids are the tokenizer's eod, as GPT-2's are its <|endoftext|>."""
    activation = "gelu_new" if m.gelu_approximation == "tanh" else "gelu"
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
        "n_positions": m.max_positions, "n_embd": m.hidden_size, "n_layer": m.num_layers,
        "n_head": m.num_attention_heads, "n_inner": m.ffn_size, "activation_function": activation,
        "layer_norm_epsilon": m.norm_epsilon, "initializer_range": m.init_method_std,
        "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "torch_dtype": "float32",
        "bos_token_id": eod, "eos_token_id": eod,
    }  # fmt: skip


def gpt2_overrides(config: dict, tensors: Tensors, source: str) -> dict:
    """The [model] architecture a GPT-2 config.json (read from `source`) describes."""
    activation = config.get("activation_function", "gelu_new")
    if activation not in GELU:
        raise ValueError(f"{source}: activation_function={activation!r} is not one of {tuple(GELU)} (dtgpt's MLP GeLUs)")
    hidden = config["n_embd"]
    return {
        **plain_architecture(), "num_layers": config["n_layer"], "hidden_size": hidden,
        "num_attention_heads": config["n_head"], "ffn_hidden_size": config.get("n_inner") or 4 * hidden,
        "max_position_embeddings": config["n_positions"], "norm_epsilon": config.get("layer_norm_epsilon", 1e-5),
        "bias_gelu_fusion": GELU[activation] == "tanh",  # with biases: Megatron's tanh GeLU
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
    }  # fmt: skip


LAYOUT = HFLayout("GPT2LMHeadModel", "gpt2", gpt2_problems, to_gpt2, from_gpt2, gpt2_config, gpt2_overrides)
