"""The transformer blocks of megatron-core's grad buffer, whatever their keys (buckets.py's layers).

A block's parameters sit in the buffer in its layer spec's order (layer_orders.LAYER_SPECS) under one
of three kinds of stored key:
- `decoder.layers.<name>`: the decoder layers stacked on a leading axis (every layer alike);
- `decoder.layers.<i>.<name>`: each layer apart (megatron-core keeps them so when the layers
  differ, e.g. DeepSeek's dense-first moe_layer_freq);
- `mtp.layers.<d>.transformer_layer.<name>`: a multi-token prediction depth's block.
megatron-core registers an MTP depth after the decoder's final norm and before the output layer:
its enorm, hnorm and eh_proj, its block, its final norm (module order; the buffer holds it
reversed). Measured on megatron-core 0.16.1's DDP (tests/megatron_mla_adam.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

PER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
MTP_DEPTH = re.compile(r"mtp\.layers\.(\d+)\.")
MTP_BLOCK = "transformer_layer."
MTP_BEFORE = ("enorm.weight", "enorm.bias", "hnorm.weight", "hnorm.bias", "eh_proj.weight", "eh_proj.bias")
MTP_AFTER = ("final_layernorm.weight", "final_layernorm.bias")
"""An MTP depth's own tensors, before and after its block, in module order."""


class KeyBlock(NamedTuple):
    """One transformer block's keys: `prefix` + a layer order's name; with `layer` set, a stacked
    tensor whose leading index `layer` is the block's."""

    prefix: str
    layer: int | None = None


def generic(key: str) -> str:
    """A block's key under the stacked decoder name (`decoder.layers.<name>`) and an MTP depth's
    own under `mtp.layers.<name>`, which the split tables (layer_orders.TP_DIM, ...) know; any other key unchanged."""
    if (found := PER_LAYER.match(key)) is not None:
        return "decoder.layers." + key[found.end():]
    if (found := MTP_DEPTH.match(key)) is not None:
        rest = key[found.end():]
        return "decoder.layers." + rest.removeprefix(MTP_BLOCK) if rest.startswith(MTP_BLOCK) else "mtp.layers." + rest
    return key


def is_mtp_own(key: str) -> bool:
    """An MTP depth's tensor outside its block (enorm, hnorm, eh_proj, final norm)."""
    found = MTP_DEPTH.match(key)
    return found is not None and key[found.end():] in (*MTP_BEFORE, *MTP_AFTER)


def decoder_layers(shapes: dict, model_keys: list[str]) -> int:
    """The decoder layers of a checkpoint, stacked or kept apart."""
    apart = {int(found[1]) for found in map(PER_LAYER.match, model_keys) if found}
    if apart:
        return max(apart) + 1
    stacked = [k for k in model_keys if k.startswith("decoder.layers.")]
    return shapes[stacked[0]][0] if stacked else 0


def decoder_block(model_keys: list[str], layer: int) -> KeyBlock:
    apart = any(k.startswith(f"decoder.layers.{layer}.") for k in model_keys)
    return KeyBlock(f"decoder.layers.{layer}.") if apart else KeyBlock("decoder.layers.", layer)


def mtp_block(depth: int) -> KeyBlock:
    return KeyBlock(f"mtp.layers.{depth}.{MTP_BLOCK}")


def mtp_depths(model_keys: list[str]) -> list[int]:
    return sorted({int(found[1]) for found in map(MTP_DEPTH.match, model_keys) if found})


def in_checked_block(key: str, layer: int | None, checked_layers: set[int]) -> bool | None:
    """Whether a parameter lies in a block the master-weight check reads: a decoder layer of
    `checked_layers` or any MTP depth's (one block a depth); None: outside every block."""
    if layer is not None:
        return layer in checked_layers
    if (found := PER_LAYER.match(key)) is not None:
        return int(found[1]) in checked_layers
    return True if key.startswith("mtp.") and generic(key).startswith("decoder.layers.") else None
