"""What an import from a Hugging Face directory checks before it writes anything.

A directory from elsewhere may be cut short, corrupt or inconsistent: a truncated or random
safetensors file, a header that claims more than the file holds, a config.json that is not JSON
or holds a value of the wrong type, a tokenizer.json of another shape, tensors whose sizes or
dtypes disagree with config.json, non-finite weights. Each is one ValueError naming the file and
what is wrong in it (scripts/convert_checkpoint.py prints it as one `error:` line), raised before
the checkpoint directory is created, so a refused import leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import torch

from dtgpt.config import ConfigError, ModelConfig
from dtgpt.config.loading import _check_value

Tensors = dict[str, torch.Tensor]


def read_json_object(path: Path, what: str = "JSON object") -> dict:
    """A JSON file holding one object; a ValueError naming the file otherwise."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text (is it a JSON file?)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not a {what}")
    return data


def load_safetensors(path: Path) -> Tensors:
    """Every tensor of one safetensors file; a ValueError naming the file when it cannot be read
    (cut short, random bytes, a header that claims more than the file holds)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error, OSError or a Rust panic's
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not a readable safetensors file ({path.stat().st_size} bytes): {reason}") from None


def index_files(path: Path) -> list[str]:
    """The shard files a model.safetensors.index.json names (its weight_map's values)."""
    index = read_json_object(path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{path}: no weight_map of tensor names to shard files (a model.safetensors.index.json has one)")
    bad = [v for v in weight_map.values() if Path(v).name != v]
    if bad:
        raise ValueError(f"{path}: weight_map names {bad[0]!r}, not a file beside the index")
    return sorted(set(weight_map.values()))


def config_value(config: dict, key: str, source: str, default=None, required: bool = True):
    """config.json's `key`: a ValueError naming it when missing (and required)."""
    if key in config and config[key] is not None:
        return config[key]
    if required and default is None:
        raise ValueError(f"{source}: no {key!r} (config.json names the model's sizes: is it this architecture's?)")
    return default


INTEGER_KEYS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace", "n_group", "topk_group",
                "num_experts_per_tok", "num_nextn_predict_layers")  # fmt: skip
NUMBER_KEYS = ("layer_norm_epsilon", "rms_norm_eps", "rope_theta", "routed_scaling_factor")
"""config.json keys of sizes (whole numbers) and of other numbers, in GPT-2's, Llama's and DeepSeek-V3's files."""


def check_config(config: dict, source: str) -> None:
    """config.json's sizes are whole numbers and its numbers numbers (a string "768" is refused
    by name here, before anything derives from it)."""
    for key in INTEGER_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{source}: {key}={value!r} must be a whole number >= 0")
    for key in NUMBER_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{source}: {key}={value!r} must be a number")
    if config.get("quantization_config"):  # e.g. DeepSeek-V3's published fp8 weights with their scales
        method = config["quantization_config"].get("quant_method") if isinstance(config["quantization_config"], dict) else None
        raise ValueError(f"{source}: quantization_config names quant_method={method!r}: dtgpt reads unquantized weights "
                         "(bf16, fp16 or fp32); dequantize the checkpoint first")  # fmt: skip
    if "vocab_size" not in config:
        raise ValueError(f"{source}: no 'vocab_size' (config.json names the model's vocabulary)")


def check_overrides(overrides: dict, source: str) -> dict:
    """The [model] values a config.json gave, each of its key's type (e.g. a width given as the
    string "768" is refused here, not deep inside the model's build)."""
    types = typing.get_type_hints(ModelConfig)
    checked = {}
    for key, value in overrides.items():
        try:
            checked[key] = _check_value(f"model.{key}", value, types[key])
        except ConfigError as e:
            raise ValueError(f"{source}: a value of the wrong type: {e}") from None
    return checked


def check_tensors(model: Tensors, expected: dict[str, tuple[int, ...]], source: str) -> None:
    """The converted tensors against the model config.json describes: every tensor present with
    its shape, floating point, and finite (a NaN or inf trains nothing)."""
    missing = [name for name in expected if name not in model]
    if missing:
        raise ValueError(f"{source}: the weights have no tensor for {missing[0]} (config.json and the weights disagree)")
    for name, shape in expected.items():
        t = model[name]
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{source}: {name} has shape {tuple(t.shape)} but config.json's model needs {shape} "
                "(config.json and the weights disagree)"
            )
        if not t.is_floating_point():
            raise ValueError(f"{source}: {name} holds {t.dtype}, not floating-point weights")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{source}: {name} holds non-finite values (NaN or inf): a damaged file?")


def replace_model(m: ModelConfig, overrides: dict, source: str) -> ModelConfig:
    """m with config.json's architecture, type-checked."""
    return dataclasses.replace(m, **check_overrides(overrides, source))
