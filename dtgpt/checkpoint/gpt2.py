"""The Hugging Face GPT-2 layout (model.safetensors + config.json), to and from dtgpt names.

Two layout differences matter besides the names:
- GPT-2 uses Conv1D, whose weight is (in_features, out_features): every matrix is transposed.
- dtgpt's fused QKV rows are grouped head by head, [head, (q|k|v), head_dim] (so a tp split of
  the rows gives whole heads), while GPT-2's c_attn columns are three blocks [q; k; v], each
  holding all heads in order.
GPT-2 has learned positions, a tied head, LayerNorm and the tanh GeLU ("gelu_new"); a dtgpt
model with anything else cannot be written in this layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dtgpt.config import ModelConfig

SAFETENSORS = "model.safetensors"
HF_CONFIG = "config.json"
PREFIX = "transformer."

# dtgpt block name -> GPT-2 block name; "T" marks Conv1D weights (transposed).
_BLOCK = {
    "input_norm.weight": ("ln_1.weight", False),
    "input_norm.bias": ("ln_1.bias", False),
    "attention.proj.weight": ("attn.c_proj.weight", True),
    "attention.proj.bias": ("attn.c_proj.bias", False),
    "mlp_norm.weight": ("ln_2.weight", False),
    "mlp_norm.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}
_TOP = {
    "embedding.word.weight": "wte.weight",
    "embedding.position.weight": "wpe.weight",
    "norm.weight": "ln_f.weight",
    "norm.bias": "ln_f.bias",
}


def check_compatible(cfg: ModelConfig) -> None:
    wrong = []
    if cfg.position_embedding_type != "learned_absolute":
        wrong.append(f"model.position_embedding_type={cfg.position_embedding_type!r} (GPT-2: 'learned_absolute')")
    if cfg.normalization != "LayerNorm":
        wrong.append(f"model.normalization={cfg.normalization!r} (GPT-2: 'LayerNorm')")
    if cfg.untie_embeddings_and_output_weights:
        wrong.append("model.untie_embeddings_and_output_weights=true (GPT-2 ties the head)")
    if wrong:
        raise ValueError("this model has no GPT-2 equivalent: " + "; ".join(wrong))


def _qkv_heads_to_blocks(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head, (q|k|v), hd] -> rows [(q|k|v), head, hd] (weight (3h, h) or bias (3h,))."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_blocks_to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def to_gpt2(model: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """dtgpt model state (full tensors, tied head stored once) -> GPT-2 tensors."""
    check_compatible(cfg)
    heads = cfg.num_attention_heads
    out = {PREFIX + hf: model[ours] for ours, hf in _TOP.items()}
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"{PREFIX}h.{i}."
        for ours, (hf, transpose) in _BLOCK.items():
            t = model[src + ours]
            out[dst + hf] = t.t() if transpose else t
        out[dst + "attn.c_attn.weight"] = _qkv_heads_to_blocks(model[src + "attention.qkv.weight"], heads).t()
        out[dst + "attn.c_attn.bias"] = _qkv_heads_to_blocks(model[src + "attention.qkv.bias"], heads)
    return {k: v.contiguous() for k, v in out.items()}


def from_gpt2(tensors: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """GPT-2 tensors -> dtgpt model state; the word embedding is zero-padded to `vocab_size` rows."""
    check_compatible(cfg)
    hf = {(k[len(PREFIX):] if k.startswith(PREFIX) else k): v for k, v in tensors.items()}
    heads = cfg.num_attention_heads
    model = {ours: hf[name] for ours, name in _TOP.items()}
    word = model["embedding.word.weight"]
    if word.shape[0] > vocab_size:
        raise ValueError(f"GPT-2 vocabulary {word.shape[0]} is larger than the model's {vocab_size}")
    if word.shape[0] < vocab_size:
        model["embedding.word.weight"] = torch.cat([word, word.new_zeros(vocab_size - word.shape[0], word.shape[1])])
    for i in range(cfg.num_layers):
        src, dst = f"h.{i}.", f"layers.{i}."
        for ours, (name, transpose) in _BLOCK.items():
            t = hf[src + name]
            model[dst + ours] = t.t() if transpose else t
        model[dst + "attention.qkv.weight"] = _qkv_blocks_to_heads(hf[src + "attn.c_attn.weight"].t(), heads)
        model[dst + "attention.qkv.bias"] = _qkv_blocks_to_heads(hf[src + "attn.c_attn.bias"], heads)
    return {k: v.contiguous() for k, v in model.items()}


def hf_config(cfg: ModelConfig, vocab_size: int) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
        "n_positions": cfg.max_positions, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_size, "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_epsilon, "initializer_range": cfg.init_method_std,
        "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout,
        "tie_word_embeddings": True, "torch_dtype": "float32",
    }  # fmt: skip


def model_overrides(config: dict) -> dict:
    """The [model] keys a GPT-2 config.json implies."""
    hidden = config["n_embd"]
    return {
        "num_layers": config["n_layer"], "hidden_size": hidden, "num_attention_heads": config["n_head"],
        "ffn_hidden_size": config.get("n_inner") or 4 * hidden, "max_position_embeddings": config["n_positions"],
        "norm_epsilon": config.get("layer_norm_epsilon", 1e-5), "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm", "untie_embeddings_and_output_weights": False,
    }  # fmt: skip


def write(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / SAFETENSORS), metadata={"format": "pt"})
    (directory / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    directory = Path(directory)
    return load_file(str(directory / SAFETENSORS)), json.loads((directory / HF_CONFIG).read_text())
