"""The tokenizer keys of `[data]` in a Megatron-LM checkpoint's `args`, both ways ([data] spells them
as Megatron's core_v0.16.1 arguments do, so the names are the same).

`to-megatron` records them in common.pt, as Megatron's training would. `checkpoint.use_checkpoint_args`
takes back what Megatron's load_args_from_checkpoint takes: the tokenizer type and model (unless
checkpoint.use_tokenizer_model_from_checkpoint_args is false: --no-use-tokenizer-model-from-checkpoint-args)
and the tiktoken pattern. The other keys (files, special tokens) stay the config's, as in Megatron.
"""

from __future__ import annotations

import dataclasses

from dtgpt.config import Config, DataConfig

RECORDED = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "tiktoken_pattern",
            "tiktoken_num_special_tokens", "tokenizer_special_tokens", "tokenizer_hf_include_special_tokens")  # fmt: skip

DTGPT_ONLY = ("ByteTokenizer",)
"""Tokenizer types Megatron does not build: recorded as no tokenizer_type (Megatron would refuse the name)."""


def megatron_tokenizer_args(d: DataConfig) -> dict[str, object]:
    """The run's tokenizer as Megatron's args: an unset (empty) key as None, as Megatron's parser leaves it."""
    args = {key: getattr(d, key) if getattr(d, key) not in ("", []) else None for key in RECORDED}
    if d.tokenizer_type in DTGPT_ONLY:
        args["tokenizer_type"] = None
    return args


def with_megatron_tokenizer(args, cfg: Config) -> tuple[Config, list[str]]:
    """(cfg with the tokenizer keys use_checkpoint_args takes from Megatron's `args`, where they hold
    them; the keys that changed, as section.key)."""
    keys = ("tokenizer_type", "tokenizer_model") if cfg.checkpoint.use_tokenizer_model_from_checkpoint_args else ()
    found = {key: getattr(args, key, None) for key in (*keys, "tiktoken_pattern")}
    taken = {key: value for key, value in found.items() if value is not None}
    changed = [f"data.{key}" for key, value in taken.items() if getattr(cfg.data, key) != value]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **taken)), changed
