"""Megatron's default distributed-optimizer layout (`dp_reshardable`) mapped back to its parameters.

megatron-core's distributed optimizer keeps each dtype group of parameters in one flat grad
buffer, cut into buckets; `dp_reshardable` saves each bucket's optimizer state as one flat
tensor per slot (param: the fp32 master weights, exp_avg, exp_avg_sq):

    optimizer.distributed.dp_group_idx_<M>.gbuf_idx_<G>.dtype_(<param dtype>, <grad dtype>).bucket_idx_<B>.<slot>

<M> is the model-parallel rank (tp x pp: one group at tp 1, pp 1), each tensor is the bucket's
unpadded length, and an element sits at its offset within the bucket whatever the dp size (each
dp rank saves its contiguous share at its own offset; DCP joins the shares). Within the buffer,
the parameters follow megatron-core's module order *reversed*, each starting at a multiple of 64
elements, and a bucket closes once it reaches its size (so the stored lengths tell where the
buckets end). The order is not stored: it is megatron-core's module registration order, which
differs between its local and Transformer Engine layer specs (the input norm before the
attention, or fused into linear_qkv after linear_proj). Both are tried; the one whose buckets
have exactly the stored lengths and whose master weights equal the model weights (sampled on the
non-layer tensors and layer 0) is taken. Anything else is no layout: the caller starts fresh.
"""

from __future__ import annotations

import math
import re

import torch

from dtgpt.checkpoint.megatron.regions import read_regions

BUCKET = re.compile(r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)$")
PARAM_ALIGNMENT = 64  # elements: where megatron-core's distributed optimizer starts each parameter

_ATTENTION = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_INPUT_NORM = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias")
_REST = (
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
)  # fmt: skip
LAYER_ORDERS = {
    "local": (*_INPUT_NORM, *_ATTENTION, *_REST),
    "transformer_engine": (*_ATTENTION, *_INPUT_NORM, *_REST),
}
"""A dense GPT layer's parameters in megatron-core's module order, by layer spec."""
BEFORE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
AFTER = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")

Param = tuple[str, int | None]  # (Megatron key, layer or None)


class BucketLayout:
    """Where each Megatron parameter's optimizer state sits: (key, layer) -> (bucket prefix, start)."""

    def __init__(self, places: dict[Param, tuple[str, int]]):
        self.places = places

    def locate(self, key: str, layer: int | None, slot: str) -> tuple[str, int]:
        prefix, start = self.places[(key, layer)]
        return f"{prefix}.{slot}", start


def buckets_of(shapes: dict[str, tuple[int, ...]]) -> dict[tuple, tuple[str, int]]:
    """(dp group, gbuf, dtype, bucket) -> (stored key prefix, length) of every dp_reshardable bucket."""
    found = {}
    for key, shape in shapes.items():
        match = BUCKET.match(key)
        if match and match.group(5) == "param":
            group, gbuf, dtype, bucket = match.groups()[:4]
            found[(int(group), int(gbuf), dtype, int(bucket))] = (key[: -len(".param")], shape[0])
    return found


def module_order(shapes: dict[str, tuple[int, ...]], model_keys: list[str], layer_order: tuple[str, ...]) -> list[tuple[Param, int]] | None:
    """((key, layer), numel) of every model parameter in megatron-core's module order, or None
    when a key is outside the dense GPT this order knows."""
    layer_keys = [k for k in model_keys if k.startswith("decoder.layers.")]
    unknown = [k for k in model_keys if k not in (*BEFORE, *AFTER) and k.removeprefix("decoder.layers.") not in layer_order]
    if unknown:
        return None
    num_layers = shapes[layer_keys[0]][0] if layer_keys else 0
    present = lambda keys: [k for k in keys if k in model_keys]  # noqa: E731
    order = [((k, None), math.prod(shapes[k])) for k in present(BEFORE)]
    stacked = present(f"decoder.layers.{k}" for k in layer_order)
    for layer in range(num_layers):
        order += [((k, layer), math.prod(shapes[k][1:])) for k in stacked]
    return order + [((k, None), math.prod(shapes[k])) for k in present(AFTER)]


def fit(order: list[tuple[Param, int]], buckets: list[tuple[str, int]]) -> dict[Param, tuple[str, int]] | None:
    """Each parameter's (bucket prefix, start) when megatron-core's buffer (the order reversed,
    each parameter aligned) closes its buckets at exactly the stored lengths; else None."""
    places, index, position = {}, 0, 0
    for param, numel in reversed(order):
        if index == len(buckets):
            return None
        prefix, length = buckets[index]
        position = -(-position // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        if position + numel > length:
            return None
        places[param] = (prefix, position)
        position += numel
        if position == length:
            index, position = index + 1, 0
    return places if index == len(buckets) else None


def agrees(directory, shapes: dict, places: dict[Param, tuple[str, int]], dtypes: dict) -> bool:
    """Whether the master weights at the mapped offsets, cast to the model's dtype, equal the
    model weights: first and last element of every non-layer tensor and of layer 0's."""
    requests, pairs = {}, []
    for (key, layer), (prefix, start) in places.items():
        if layer not in (None, 0):
            continue
        shape = shapes[key][1:] if layer is not None else shapes[key]
        numel = math.prod(shape)
        for end, index in (("first", 0), ("last", numel - 1)):
            name = f"{key}.{layer}.{end}"
            weight_at = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), shape)) if shape else ()
            weight_at = weight_at if layer is None else (layer, *weight_at)
            dtype = dtypes.get(key, torch.float32)
            requests[f"{name}.w"] = (key, weight_at, torch.empty((1,) * len(weight_at), dtype=dtype))
            requests[f"{name}.m"] = (f"{prefix}.param", (start + index,), torch.empty(1, dtype=dtypes.get(f"{prefix}.param", torch.float32)))
            pairs.append((f"{name}.w", f"{name}.m", dtype))
    read_regions(directory, requests)
    return all(torch.equal(requests[w][2].flatten(), requests[m][2].to(dtype)) for w, m, dtype in pairs)


def bucket_layout(directory, shapes: dict, dtypes: dict, model_keys: list[str]) -> tuple[BucketLayout | None, str]:
    """The dp_reshardable layout of a checkpoint, or (None, why not)."""
    buckets = buckets_of(shapes)
    groups = {k[:3] for k in buckets}
    if len({g for g, _, _ in groups}) > 1:
        return None, "it was saved with tensor or pipeline parallelism (one bucket set per model-parallel rank), which dtgpt does not map yet"
    if len(groups) > 1:
        return None, "it holds several grad buffers (parameter dtypes or experts), which dtgpt does not map yet"
    stored = [buckets[k] for k in sorted(buckets, key=lambda k: k[3])]
    for spec, layer_order in LAYER_ORDERS.items():
        order = module_order(shapes, model_keys, layer_order)
        places = order and fit(order, stored)
        if places and agrees(directory, shapes, places, dtypes):
            return BucketLayout(places), spec
    return None, "its buckets do not match megatron-core's parameter order for this model (dense GPT, local or Transformer Engine spec)"
