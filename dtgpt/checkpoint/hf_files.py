"""A Hugging Face model directory (model.safetensors, config.json, generation_config.json) and
what its layouts, GPT-2 (gpt2.py), Llama (hf_llama.py) and DeepSeek-V3 (hf_deepseek.py), share. The tokenizer files
beside them: hf_tokenizer.py.

A layout is an `HFLayout`: the architecture it writes, the [model] settings it cannot express,
and the maps of tensors and config.json both ways. Conversions see full tensors in dtgpt's
names, norm weights as gamma (apply_layernorm_1p's gamma - 1 is undone before and redone after:
`gamma_from_stored`, `stored_from_gamma`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from dtgpt.checkpoint import hf_checks
from dtgpt.checkpoint.architecture import FIELDS
from dtgpt.config import ModelConfig
from dtgpt.model import OUTPUT_WEIGHT, WORD_EMBEDDING

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"  # a model saved in several shards
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

Tensors = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class HFLayout:
    architecture: str
    """config.json's architectures[0] (the transformers class), e.g. "LlamaForCausalLM"."""
    model_type: str
    problems: Callable[[ModelConfig], list[str]]
    """The [model] settings this layout cannot express, each as `need` words it; [] if none."""
    to_hf: Callable[[Tensors, ModelConfig], Tensors]
    """dtgpt model state (gamma norms, tied head stored once) -> the layout's tensors."""
    from_hf: Callable[[Tensors, ModelConfig, int], Tensors]
    """The layout's tensors -> dtgpt model state with the word embedding padded to `vocab_size` rows."""
    config: Callable[[ModelConfig, int, int], dict]
    """config.json of a model (cfg, padded vocabulary, eod)."""
    overrides: Callable[[dict, Tensors, str], dict]
    """The [model] architecture a config.json (and its tensors) describe; errors name `source`."""
    holds_experts: bool = False
    """Whether it holds mixture-of-experts blocks and multi-token prediction modules."""


def need(key: str, wanted, m: ModelConfig) -> str:
    """A setting a layout needs, as "model.key=wanted (the config has value)"."""
    return f"model.{key}={_toml(wanted)} (the config has {_toml(getattr(m, key))})"


def unmet(m: ModelConfig, wanted: dict[str, object]) -> list[str]:
    """`need` of each [model] key whose value is not the wanted one."""
    return [need(key, value, m) for key, value in wanted.items() if getattr(m, key) != value]


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


CONVENTIONS = ("apply_layernorm_1p", "rotary_interleaved")
"""[model] keys of how a model stores the same function (gamma or gamma - 1; RoPE's channel pairs,
a reordering of q and k): an import keeps the importing config's and converts the tensors to it."""


def plain_architecture() -> dict[str, object]:
    """Every [model] architecture key at its default, but the CONVENTIONS."""
    defaults = ModelConfig()
    return {key: getattr(defaults, key) for key in FIELDS if key not in CONVENTIONS}


def rope_keys(config: dict, source: str) -> tuple[dict, dict, int]:
    """config.json's RoPE keys, legacy or transformers 5's: (rope_parameters, the scaling, the
    base as the integer model.rotary_base is)."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ValueError(f"{source}: rope_theta={theta} is not a whole number (dtgpt's model.rotary_base is an integer)")
    return parameters, scaling, int(theta)


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")  # input_norm, mlp_norm, norm, q_norm, k_norm


def gamma_from_stored(model: Tensors, m: ModelConfig) -> Tensors:
    """Norm weights as gamma, whatever apply_layernorm_1p stored (gamma - 1): Hugging Face's
    layouts hold gamma itself, so an export folds the + 1 in."""
    return {k: v + 1 if m.apply_layernorm_1p and _is_norm(k) else v for k, v in model.items()}


def stored_from_gamma(model: Tensors, m: ModelConfig) -> Tensors:
    return {k: v - 1 if m.apply_layernorm_1p and _is_norm(k) else v for k, v in model.items()}


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to `rows` (the padded vocabulary)."""
    if t.shape[0] > rows:
        raise ValueError(f"the Hugging Face vocabulary {t.shape[0]} is larger than the model's {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def top_to_hf(model: Tensors, top: dict[str, str], lm_head: str, m: ModelConfig) -> Tensors:
    """The tensors outside the blocks (`top`: dtgpt name -> the layout's), the head if untied."""
    out = {hf: model[ours] for ours, hf in top.items()}
    if m.untie_embeddings_and_output_weights:
        out[lm_head] = model[OUTPUT_WEIGHT]
    return out


def top_from_hf(hf: Tensors, top: dict[str, str], lm_head: str, m: ModelConfig, vocab_size: int) -> Tensors:
    """top_to_hf's way back, the word embedding (and untied head) zero-padded to `vocab_size` rows."""
    model = {ours: hf[name] for ours, name in top.items()}
    model[WORD_EMBEDDING] = pad_rows(model[WORD_EMBEDDING], vocab_size)
    if m.untie_embeddings_and_output_weights:
        model[OUTPUT_WEIGHT] = pad_rows(hf[lm_head], vocab_size)
    return model


def bias_or_zeros(model: Tensors, name: str, size: int) -> torch.Tensor:
    """model[name], or zeros where the dtgpt model has no such bias (the same function)."""
    return model[name] if name in model else torch.zeros(size)


class Named(dict):
    """A layout's tensors by name; a missing one is a ValueError that names it."""

    def __init__(self, tensors: Tensors, layout: str):
        super().__init__(tensors)
        self.layout = layout

    def __missing__(self, name: str):
        raise ValueError(f"the {self.layout} weights have no tensor {name!r} (config.json and the weights disagree)")


def generation_config(eod: int, tokenizer_vocab: int, vocab_size: int) -> dict:
    """generation_config.json: stop at the eod, pad with it, never emit a padded-vocabulary row."""
    padding = list(range(tokenizer_vocab, vocab_size))
    settings = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}
    return {**settings, "suppress_tokens": padding} if padding else settings


def write_hf_dir(directory: str | Path, tensors: Tensors, config: dict, generation: dict) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (directory / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tensors, str(directory / SAFETENSORS), metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600); give the weights the
    # mode the process umask gave config.json, like every other file dtgpt writes.
    shutil.copymode(directory / HF_CONFIG, directory / SAFETENSORS)


def read_hf_dir(directory: str | Path) -> tuple[Tensors, dict]:
    """The tensors (one file, or the shards an index names) and config.json of a directory; a
    file that cannot be read is a ValueError naming it (hf_checks.py)."""
    directory = Path(directory)
    if not (directory / HF_CONFIG).is_file():
        raise ValueError(f"{directory}: no {HF_CONFIG}; not a Hugging Face model directory")
    config = hf_checks.read_json_object(directory / HF_CONFIG, "model config")
    hf_checks.check_config(config, str(directory / HF_CONFIG))
    if (directory / SAFETENSORS).is_file():
        files = [SAFETENSORS]
    elif (directory / SAFETENSORS_INDEX).is_file():
        files = hf_checks.index_files(directory / SAFETENSORS_INDEX)
        absent = [name for name in files if not (directory / name).is_file()]
        if absent:
            raise ValueError(f"{directory / SAFETENSORS_INDEX}: names {absent[0]}, which is not in {directory}")
    else:
        raise ValueError(f"{directory}: no {SAFETENSORS} or {SAFETENSORS_INDEX}")
    tensors = {k: v for name in files for k, v in hf_checks.load_safetensors(directory / name).items()}
    return tensors, config
