"""The Hugging Face GPT-2 layout (model.safetensors, config.json, generation_config.json), to
and from dtgpt names. The tokenizer files beside them: hf_tokenizer.py.

Two layout differences matter besides the names:
- GPT-2 uses Conv1D, whose weight is (in_features, out_features): every matrix is transposed.
- dtgpt's fused QKV rows are grouped head by head, [head, (q|k|v), head_dim] (so a tp split of
  the rows gives whole heads), while GPT-2's c_attn columns are three blocks [q; k; v], each
  holding all heads in order.
GPT-2 has learned positions, LayerNorm and the tanh GeLU ("gelu_new"); a dtgpt model with
anything else cannot be written in this layout. An untied head is GPT-2's `lm_head.weight` with
`tie_word_embeddings: false`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dtgpt.config import ModelConfig
from dtgpt.model import OUTPUT_WEIGHT, WORD_EMBEDDING

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"  # a model saved in several shards
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
PREFIX = "transformer."
LM_HEAD = "lm_head.weight"
# Both names are GPT-2's tanh approximation of GeLU, the MLP activation of dtgpt's model.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")

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
    if wrong:
        raise ValueError("this model has no GPT-2 equivalent: " + "; ".join(wrong))


def _qkv_heads_to_blocks(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head, (q|k|v), hd] -> rows [(q|k|v), head, hd] (weight (3h, h) or bias (3h,))."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_blocks_to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to `rows` (the padded vocabulary)."""
    if t.shape[0] > rows:
        raise ValueError(f"GPT-2 vocabulary {t.shape[0]} is larger than the model's {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class _Named(dict):
    """GPT-2 tensors by name; a missing one is a ValueError that names it."""

    def __missing__(self, name: str):
        raise ValueError(f"the GPT-2 weights have no tensor {name!r} (config.json and the weights disagree)")


def to_gpt2(model: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """dtgpt model state (full tensors, tied head stored once) -> GPT-2 tensors."""
    check_compatible(cfg)
    heads = cfg.num_attention_heads
    out = {PREFIX + hf: model[ours] for ours, hf in _TOP.items()}
    if cfg.untie_embeddings_and_output_weights:
        out[LM_HEAD] = model[OUTPUT_WEIGHT]
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
    hf = _Named({(k[len(PREFIX):] if k.startswith(PREFIX) else k): v for k, v in tensors.items()})
    heads = cfg.num_attention_heads
    model = {ours: hf[name] for ours, name in _TOP.items()}
    model[WORD_EMBEDDING] = _pad_rows(model[WORD_EMBEDDING], vocab_size)
    if cfg.untie_embeddings_and_output_weights:
        model[OUTPUT_WEIGHT] = _pad_rows(hf[LM_HEAD], vocab_size)
    for i in range(cfg.num_layers):
        src, dst = f"h.{i}.", f"layers.{i}."
        for ours, (name, transpose) in _BLOCK.items():
            t = hf[src + name]
            model[dst + ours] = t.t() if transpose else t
        model[dst + "attention.qkv.weight"] = _qkv_blocks_to_heads(hf[src + "attn.c_attn.weight"].t(), heads)
        model[dst + "attention.qkv.bias"] = _qkv_blocks_to_heads(hf[src + "attn.c_attn.bias"], heads)
    return {k: v.contiguous() for k, v in model.items()}


def hf_config(cfg: ModelConfig, vocab_size: int, eod: int) -> dict:
    """config.json; both special-token ids are the tokenizer's eod, as GPT-2's are its <|endoftext|>."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
        "n_positions": cfg.max_positions, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_size, "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_epsilon, "initializer_range": cfg.init_method_std,
        "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "torch_dtype": "float32",
        "bos_token_id": eod, "eos_token_id": eod,
    }  # fmt: skip


def generation_config(eod: int, tokenizer_vocab: int, vocab_size: int) -> dict:
    """generation_config.json: stop at the eod, pad with it, never emit a padded-vocabulary row."""
    padding = list(range(tokenizer_vocab, vocab_size))
    settings = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}
    return {**settings, "suppress_tokens": padding} if padding else settings


def model_overrides(config: dict, source: str = HF_CONFIG) -> dict:
    """The [model] keys a GPT-2 config.json (read from `source`) implies."""
    activation = config.get("activation_function", "gelu_new")
    if activation not in TANH_GELU:
        raise ValueError(f"{source}: activation_function={activation!r} is not one of {TANH_GELU} (dtgpt's MLP GeLU)")
    hidden = config["n_embd"]
    return {
        "num_layers": config["n_layer"], "hidden_size": hidden, "num_attention_heads": config["n_head"],
        "ffn_hidden_size": config.get("n_inner") or 4 * hidden, "max_position_embeddings": config["n_positions"],
        "norm_epsilon": config.get("layer_norm_epsilon", 1e-5), "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm", "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
    }  # fmt: skip


def write_gpt2_dir(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict, generation: dict) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (directory / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tensors, str(directory / SAFETENSORS), metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600); give the weights the
    # mode the process umask gave config.json, like every other file dtgpt writes.
    shutil.copymode(directory / HF_CONFIG, directory / SAFETENSORS)


def read_gpt2_dir(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors (one file, or the shards an index names) and config.json of a GPT-2 directory."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / HF_CONFIG).is_file():
        raise ValueError(f"{directory}: no {HF_CONFIG}; not a Hugging Face model directory")
    if (directory / SAFETENSORS).is_file():
        files = [SAFETENSORS]
    elif (directory / SAFETENSORS_INDEX).is_file():
        files = sorted(set(json.loads((directory / SAFETENSORS_INDEX).read_text())["weight_map"].values()))
    else:
        raise ValueError(f"{directory}: no {SAFETENSORS} or {SAFETENSORS_INDEX}")
    tensors = {k: v for name in files for k, v in load_file(str(directory / name)).items()}
    return tensors, json.loads((directory / HF_CONFIG).read_text())
