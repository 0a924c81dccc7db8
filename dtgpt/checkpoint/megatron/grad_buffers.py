"""The grad buffers a dp_reshardable checkpoint holds, read from its stored keys alone.

megatron-core's distributed optimizer saves each bucket of each grad buffer as one flat tensor
per slot, keyed

    (chained_<C>.)optimizer.distributed.dp_group_idx_<M>.gbuf_idx_<G>.dtype_(<param dtype>, <grad dtype>).bucket_idx_<B>.<slot>

<M> a model-parallel rank; <G> counts the rank's buffers: one per model chunk (a DDP each: with
virtual pipeline stages, vp of them) and, within a chunk, one per parameter dtype; <C> a chained
optimizer (an MoE model's experts at ep > 1 have one of their own, chained_1, whose <G> counts
the chunks' expert buffers alike: megatron-core chains each chunk's buffers in chunk order). Where each
parameter sits in a buffer is buckets.py's concern.
"""

from __future__ import annotations

import re

BUCKET = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)$")
"""A bucket's stored key: (chained optimizer,) model-parallel rank, grad buffer, dtypes, bucket, slot.
An MoE model's experts have an optimizer of their own (chained_1), with its own buffers."""


def buckets_of(shapes: dict[str, tuple[int, ...]]) -> dict[tuple, tuple[str, int]]:
    """(model-parallel rank, grad buffer, bucket) -> (stored key prefix, length) of every
    dp_reshardable bucket; a grad buffer is (chained optimizer, gbuf index, dtypes)."""
    found = {}
    for key, shape in shapes.items():
        match = BUCKET.match(key)
        if match and match.group(6) == "param":
            chain, rank, gbuf, dtype, bucket = match.groups()[:5]
            found[(int(rank), (int(chain or 0), int(gbuf), dtype), int(bucket))] = (key[: -len(".param")], shape[0])
    return found


def grad_buffers(buckets: dict[tuple, tuple[str, int]], vp: int) -> tuple[dict[int, dict[int, list[list]]], str]:
    """chained optimizer -> model-parallel rank -> its grad buffers in gbuf order, each its
    [(prefix, length)] by bucket, when every rank holds one buffer per model chunk (`vp` of them,
    in the dense optimizer and in the experts'); else ({}, why not)."""
    if len({key[:2] for key in buckets}) > len({(rank, chain, gbuf) for rank, (chain, gbuf, _), _ in buckets}):
        return {}, "it holds two parameter dtypes under one gbuf index, which megatron-core does not write"
    stored: dict[int, dict[int, dict[int, list]]] = {}
    for (rank, (chain, gbuf, _), _), bucket in sorted(buckets.items(), key=lambda item: item[0][2]):
        stored.setdefault(chain, {}).setdefault(rank, {}).setdefault(gbuf, []).append(bucket)
    for chain, ranks in stored.items():
        owner = "the experts' " if chain else ""
        for rank, buffers in ranks.items():
            if sorted(buffers) != list(range(vp)):
                return {}, (f"{owner}model-parallel rank {rank} holds {len(buffers)} grad buffers where "
                            f"its args give {vp} model chunk{'s' if vp > 1 else ''} (mixed parameter dtypes, or virtual stages its "
                            "args do not give), which dtgpt does not map yet")  # fmt: skip
    return {chain: {rank: [buffers[g] for g in sorted(buffers)] for rank, buffers in ranks.items()} for chain, ranks in stored.items()}, ""
