"""Megatron's default distributed-optimizer layout (`dp_reshardable`) mapped back to its parameters.

megatron-core's distributed optimizer keeps each dtype group of parameters in one flat grad
buffer, cut into buckets; `dp_reshardable` saves each bucket's optimizer state as one flat
tensor per slot (param: the fp32 master weights, exp_avg, exp_avg_sq):

    optimizer.distributed.dp_group_idx_<M>.gbuf_idx_<G>.dtype_(<param dtype>, <grad dtype>).bucket_idx_<B>.<slot>

<M> is the rank in megatron-core's model-parallel group, tp rank + tp x pp rank (its rank
generator numbers the tp-pp group with tp fastest); each such rank saves the buckets of its own
parameters: its pipeline stage's layers (Megatron's split, stages.py), the embedding on the first
stage, the final norm and head on the last (with a tied head at pp > 1, the last stage's own
copy of the embedding, in a bucket of its own). With virtual pipeline stages (interleaved 1F1B)
a pp rank holds vp model chunks, each wrapped in a DDP of its own: <G> numbers them (one
parameter dtype each), and chunk c of pp rank r is virtual stage c x pp + r of Megatron's split
into pp x vp stages (the embedding in chunk 0 of the first pp rank, the head in the last chunk of
the last), its buffer cut by the rules below as a whole stage's. Each parameter is its tp shard
(TP_DIM: rows or columns of the global tensor; SwiGLU's linear_fc1 shard is [its gate rows; its up
rows]; the rest whole, replicated; LayerSpec.whole: what a spec keeps whole that TP_DIM splits).
Each tensor is the bucket's unpadded length, and an element sits at its offset within the bucket
whatever the dp size (each dp rank saves its contiguous share at its own offset; DCP joins the
shares). Within the buffer, the parameters follow megatron-core's module order *reversed*, each
starting at a multiple of 64 elements, and a bucket closes once it reaches its size (so the stored
lengths tell where the buckets end). The order is not stored: it is megatron-core's module
registration order, which differs between its local and Transformer Engine layer specs (the input
norm before the attention, or fused into linear_qkv after linear_proj; multi-latent attention's
down-projections split by rows, or whole on every tp rank, its compressed vectors' norms after the
up-projections, or fused into them). Both are tried; the one whose buckets have exactly the stored
lengths and whose master weights equal the model weights (agrees, on a bounded set of small tensors:
bucket_checks) is taken. Anything else is no layout: the caller starts fresh. Which buckets each
rank's grad buffers hold, from the stored keys: grad_buffers.py. An MoE model's routed experts sit
in the dense buffer at ep 1 and in buffers of their own (chained_1) at ep > 1: expert_buckets.py. A
DeepSeek-style model's blocks (its layers kept apart under their own keys, its MTP depths between
the final norm and the head): bucket_blocks.py.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch

from dtgpt.checkpoint.megatron.bucket_blocks import (
    MTP_AFTER, MTP_BEFORE, MTP_BLOCK, KeyBlock, decoder_block, decoder_layers, generic, in_checked_block, is_mtp_own, mtp_block, mtp_depths,
)  # fmt: skip
from dtgpt.checkpoint.megatron.expert_buckets import (
    EXPERT_ORDERS, EXPERT_TP_DIM, EXPERTS, ExpertSplit, expert_checks, expert_entries, is_expert_key, num_experts, rank_split,
)  # fmt: skip
from dtgpt.checkpoint.megatron.grad_buffers import buckets_of, grad_buffers
from dtgpt.checkpoint.megatron.layer_orders import (
    AFTER, BEFORE, BUFFERS, FINAL_NORM, LAYER_SPECS, MTP_EMBEDDING_COPY, TIED_HEAD, TP_DIM, LayerSpec, swiglu_keys,
)  # fmt: skip
from dtgpt.checkpoint.megatron.regions import read_regions

PARAM_ALIGNMENT = 64  # elements: where megatron-core's distributed optimizer starts each parameter


def aligned(position: int) -> int:
    """The first place at or after `position` where megatron-core's grad buffer starts a parameter."""
    return -(-position // PARAM_ALIGNMENT) * PARAM_ALIGNMENT

Param = tuple[str, int | None]  # (Megatron key, layer or None)


class Parallel(NamedTuple):
    """The model parallelism a checkpoint was saved with (from its args)."""

    tp: int = 1
    stage_layers: tuple[int, ...] = ()  # the decoder layers of each (virtual) pipeline stage; () for pp 1
    ep: int = 1  # expert parallelism
    etp: int = 1  # the experts' tp: 1 (each expert whole on every tp rank) or tp (split as the dense MLP)
    vp: int = 1  # virtual stages per pp rank: stage_layers lists pp x vp stages, stage c x pp + r in chunk c of pp rank r

    @property
    def pp(self) -> int:
        return len(self.stage_layers) // self.vp or 1


class Piece(NamedTuple):
    """A contiguous run of a bucket holding a row-major block of a parameter's global tensor."""

    prefix: str  # the bucket's stored key without the slot
    start: int  # its first element's offset in the bucket
    shape: tuple[int, ...]  # the block's shape
    offsets: tuple[int, ...]  # where the block sits in the global tensor (one layer's)


class BucketLayout:
    """Where each Megatron parameter's optimizer state sits: (key, layer) -> its pieces."""

    def __init__(self, pieces: dict[Param, list[Piece]], experts: str = ""):
        self.pieces = pieces
        self.experts = experts  # the routed experts' module, whose parameter order they follow ("": no experts)


def local_shape(key: str, shape: tuple[int, ...], tp: int, spec: LayerSpec) -> tuple[int, ...]:
    """A parameter's shape on one tp rank under `spec` (one layer's `shape` for a layer's)."""
    dim = spec.tp_dim(key)
    return shape if dim is None else (*shape[:dim], shape[dim] // tp, *shape[dim + 1:])


def stage_layers(shapes: dict, model_keys: list[str], stage: int, parallel: Parallel) -> range:
    """The decoder layers (numbered globally) of pipeline stage `stage`."""
    counts = parallel.stage_layers or (decoder_layers(shapes, model_keys),)
    return range(sum(counts[:stage]), sum(counts[: stage + 1]))


def stage_key_blocks(shapes: dict, model_keys: list[str], stage: int, parallel: Parallel) -> list[KeyBlock]:
    """The transformer blocks of pipeline stage `stage` in module order: its decoder layers, and on
    the last stage each MTP depth's block (after the final norm)."""
    blocks = [decoder_block(model_keys, layer) for layer in stage_layers(shapes, model_keys, stage, parallel)]
    if stage == (len(parallel.stage_layers) or 1) - 1:
        blocks += [mtp_block(depth) for depth in mtp_depths(model_keys)]
    return blocks


def block_order(shapes: dict, model_keys: list[str], spec: LayerSpec, block: KeyBlock, tp: int,
                experts: ExpertSplit | None) -> list[tuple[tuple, tuple]]:
    """((key, layer, expert), local shape) of one block's parameters in `spec`'s order."""
    order = []
    for name in spec.order:
        key = block.prefix + name
        if name == EXPERTS and experts is not None:
            order += expert_entries(shapes, model_keys, block, experts)
        elif key in model_keys:
            order.append(((key, block.layer, None), local_shape(key, shapes[key][block.layer is not None:], tp, spec)))
    return order


def stage_order(shapes: dict, model_keys: list[str], spec: LayerSpec, stage: int, parallel: Parallel,
                experts: ExpertSplit | None = None) -> list[tuple[tuple, tuple]] | None:
    """((key, layer, expert), local shape) of pipeline stage `stage`'s parameters in megatron-core's
    module order (layers numbered globally; expert None but for the routed experts, which this
    buffer holds only where `experts` says), or None when a key is outside the GPT this order knows."""
    unknown = [k for k in model_keys if k not in (*BEFORE, *AFTER) and generic(k).removeprefix("decoder.layers.") not in spec.order
               and not is_expert_key(k) and not is_mtp_own(k)]  # fmt: skip
    if unknown:
        return None
    last = stage == (len(parallel.stage_layers) or 1) - 1
    whole = lambda keys: [((k, None, None), local_shape(k, shapes[k], parallel.tp, spec)) for k in keys if k in model_keys]  # noqa: E731
    order = whole(BEFORE) if stage == 0 else []
    if last and stage > 0 and mtp_depths(model_keys):  # the MTP block's own copy of the word embedding, first in module order
        order.append(((MTP_EMBEDDING_COPY, None, None), local_shape(BEFORE[0], shapes[BEFORE[0]], parallel.tp, spec)))
    for layer in stage_layers(shapes, model_keys, stage, parallel):
        order += block_order(shapes, model_keys, spec, decoder_block(model_keys, layer), parallel.tp, experts)
    if last:
        order += whole(FINAL_NORM)
        for depth in mtp_depths(model_keys):  # between the decoder's final norm and the head
            block = mtp_block(depth)
            own = lambda names: whole([block.prefix.removesuffix(MTP_BLOCK) + name for name in names])  # noqa: E731
            order += own(MTP_BEFORE) + block_order(shapes, model_keys, spec, block, parallel.tp, experts) + own(MTP_AFTER)
        order += whole(AFTER[2:])
        if TIED_HEAD not in model_keys and parallel.pp > 1:  # the tied head's copy
            order.append(((TIED_HEAD, None, None), local_shape(TIED_HEAD, shapes[BEFORE[0]], parallel.tp, spec)))
    return order


def fit(order: list[tuple[Param, int]], buckets: list[tuple[str, int]]) -> dict[Param, tuple[str, int]] | None:
    """Each parameter's (bucket prefix, start) when megatron-core's buffer (the order reversed,
    each parameter aligned) closes its buckets at exactly the stored lengths; else None. A bucket
    closed before a parameter that takes a bucket of its own (a pipeline's tied embedding) ends
    where that parameter would have started: at its last parameter's end, aligned."""
    places, index, position = {}, 0, 0
    for param, numel in reversed(order):
        if index == len(buckets):
            return None
        prefix, length = buckets[index]
        position = aligned(position)
        if position + numel > length:
            return None
        places[param] = (prefix, position)
        position += numel
        if length in (position, aligned(position)):
            index, position = index + 1, 0
    return places if index == len(buckets) else None


def shard_pieces(dim: int | None, shape: tuple[int, ...], prefix: str, start: int, tp: int, rank: int, halves: int) -> list[Piece]:
    """Tp rank `rank`'s shard (split on `dim`; None: whole) of a parameter of global (one layer's)
    `shape`, stored from `start` of bucket `prefix`, as blocks of the global tensor. With SwiGLU
    (`halves` 2) linear_fc1's rows are [gate; up] globally and [gate shard; up shard] on each rank: two blocks."""
    if dim is None:
        return [Piece(prefix, start, shape, (0,) * len(shape))]
    part = shape[dim] // tp // halves
    block = (*shape[:dim], part, *shape[dim + 1:])
    at = lambda half: tuple((half * tp + rank) * part if d == dim else 0 for d in range(len(shape)))  # noqa: E731
    return [Piece(prefix, start + half * math.prod(block), block, at(half)) for half in range(halves)]


def rank_pieces(shapes: dict, model_keys: list[str], spec: LayerSpec, stored: dict[int, list[list]], parallel: Parallel,
                expert_module: str = "SequentialMLP", expert_stored: dict[int, list] | None = None) -> dict[Param, list[Piece]] | None:
    """Every parameter's pieces, from the buckets of each model-parallel rank (stored: rank -> its
    grad buffers, one per model chunk, each [(prefix, length)] by bucket; expert_stored: the
    experts' own buffers, chained_1, by expert model-parallel rank, one per model chunk too, or
    None: the dense buffers hold the experts), when each rank's buckets fit
    its parameters in `spec`'s order; else None. A parameter whole on every tp rank is read from tp
    rank 0's copy; a routed expert's tensor is a block of its own at its expert's index, split
    over the expert tp ranks (parallel.etp) as the dense MLP's (at expert tp 1 a replica on every tp rank)."""
    gated = swiglu_keys(shapes)
    experts = num_experts(shapes, model_keys)
    inline = ExpertSplit(range(experts), expert_module, parallel.etp) if expert_stored is None else None
    fits = []  # (order, buckets, tp rank) of every buffer
    for stage in range(len(parallel.stage_layers) or 1):
        order = stage_order(shapes, model_keys, spec, stage, parallel, inline)
        if order is None:
            return None
        pp_rank, chunk = stage % parallel.pp, stage // parallel.pp
        fits += [(order, stored[rank + parallel.tp * pp_rank][chunk], rank) for rank in range(parallel.tp)]
    for rank, buffers in sorted((expert_stored or {}).items()):
        pp_rank, split = rank_split(rank, parallel.ep, experts, expert_module, parallel.etp)
        for chunk, buckets in enumerate(buffers):  # chunk c holds virtual stage c x pp + pp rank, as the dense buffers
            blocks = stage_key_blocks(shapes, model_keys, chunk * parallel.pp + pp_rank, parallel)
            order = [entry for block in blocks for entry in expert_entries(shapes, model_keys, block, split)]
            fits.append((order, buckets, split.tp_rank))
    pieces: dict[Param, list[Piece]] = {}
    for order, buckets, rank in fits:
        places = fit([(param, math.prod(shape)) for param, shape in order], buckets)
        if places is None:
            return None
        for (key, layer, expert), (prefix, start) in places.items():
            split_dim = spec.tp_dim(key) if expert is None else EXPERT_TP_DIM.get(generic(key)) if parallel.etp > 1 else None
            if key not in model_keys or (rank > 0 and split_dim is None):
                continue  # a tied head's or the MTP block's copy; a tp replica
            shape = shapes[key] if layer is None else shapes[key][1:]
            if expert is None:
                found = shard_pieces(split_dim, shape, prefix, start, parallel.tp, rank, 1 + (key in gated))
            else:  # one expert's blocks, at its index on the experts' axis
                found = shard_pieces(split_dim, shape[1:], prefix, start, parallel.etp, rank, 1 + (key in gated))
                found = [Piece(p.prefix, p.start, (1, *p.shape), (expert, *p.offsets)) for p in found]
            pieces.setdefault((key, layer), []).extend(found)
    return pieces


Region = tuple[str, tuple[int, ...], tuple[int, ...]]  # (stored key, offsets, shape)
Check = tuple[Region, Region]
"""(model weight region, fp32 master weight region of as many elements): a tensor to compare."""


def agrees(directory, dtypes: dict, checks: list[Check], chunks: dict[str, list[int]] | None = None) -> bool:
    """Whether each checked fp32 master weight, cast to the model's dtype, equals the model weight
    it belongs to, in one DCP read. The master regions are runs of 1-D buckets, merged per stored
    chunk (chunks: key -> where its stored chunks start; none given, one) so that DCP, which reads
    a whole chunk per request that touches it, reads each once."""
    region = lambda key, offsets, shape: (key, offsets, torch.empty(shape, dtype=dtypes.get(key, torch.float32)))  # noqa: E731
    runs = merged_runs([master for _, master in checks if len(master[2]) == 1], chunks or {})
    requests = {f"run{j}": region(key, (start,), (end - start,)) for j, (key, start, end) in enumerate(runs)}
    for i, (weight, master) in enumerate(checks):
        requests[f"{i}.w"] = region(*weight)
        if len(master[2]) > 1:
            requests[f"{i}.m"] = region(*master)
    read_regions(directory, requests)

    def master_values(i: int, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) > 1:
            return requests[f"{i}.m"][2].flatten()
        j = next(j for j, (run_key, start, end) in enumerate(runs) if run_key == key and start <= offsets[0] < end)
        return requests[f"run{j}"][2][offsets[0] - runs[j][1] :][: shape[0]]

    weights = [requests[f"{i}.w"][2].flatten() for i in range(len(checks))]
    return all(torch.equal(weights[i], master_values(i, *master).to(weights[i].dtype)) for i, (_, master) in enumerate(checks))


def merged_runs(regions: list[Region], chunks: dict[str, list[int]]) -> list[tuple[str, int, int]]:
    """(key, start, end) runs covering the 1-D `regions`, merged where they touch a stored chunk in
    common (chunks: key -> its chunks' starts), so that no two runs touch one chunk."""
    chunk = lambda key, at: bisect.bisect_right(chunks.get(key, [0]), at)  # noqa: E731
    runs: list[tuple[str, int, int]] = []
    for key, (start,), (numel,) in sorted(regions):
        if runs and runs[-1][0] == key and chunk(key, start) <= chunk(key, runs[-1][2] - 1):
            runs[-1] = (key, runs[-1][1], max(runs[-1][2], start + numel))
        else:
            runs.append((key, start, start + numel))
    return runs


def bucket_checks(pieces: dict[Param, list[Piece]], checked_layers: set[int]) -> list[Check]:
    """The whole 1-D tensors (norms, biases; TP_DIM splits none of them) outside the layers and in
    `checked_layers`, each against its run of its bucket.

    The bound: a model weight region is one layer's 1-D tensor (its stored chunk is that small), a
    master region one contiguous run of a bucket (agrees reads each stored chunk it touches, a dp
    share of a bucket, once), and there are at most 2 + 10 x len(checked_layers) checks (the final
    norm's and each layer's 1-D tensors) and 14 an MTP depth (its norms and its block's), whatever the layer count, tp, pp and dp. It still catches what the check
    is for: the 1-D tensors sit between the matrices in the buffer, so a wrong start or a wrong
    layer order (the input norm before or after linear_proj) moves them onto other elements."""
    checks = []
    for (key, layer), found in pieces.items():
        if in_checked_block(key, layer, checked_layers) is False or generic(key) in TP_DIM or len(found[0].shape) != 1:
            continue
        (prefix, start, (numel,), _), at = found[0], () if layer is None else (layer,)
        checks.append(((key, (*at, 0), (*(1,) * len(at), numel)), (f"{prefix}.param", (start,), (numel,))))
    return checks


def bucket_layout(directory, shapes: dict, dtypes: dict, model_keys: list[str], parallel: Parallel | None,
                  chunks: dict[str, list[int]] | None = None) -> tuple[BucketLayout | None, str]:
    """The dp_reshardable layout of a checkpoint saved with `parallel` (None: its args are
    unknown; chunks: where each bucket's stored chunks start), or (None, why not)."""
    model_keys = [k for k in model_keys if generic(k) not in BUFFERS]
    stored, why = grad_buffers(buckets_of(shapes), parallel.vp if parallel else 1)
    experts = num_experts(shapes, model_keys)
    if why or not set(stored) <= ({0, 1} if experts else {0}):
        return None, why or "it holds optimizer buckets of chained optimizers other than an MoE model's experts'"
    ranks = sorted(stored[0]) if 0 in stored else []
    if parallel is None and ranks != [0]:
        return None, f"it was saved by {len(ranks)} model-parallel ranks and the checkpoint's args do not say its tp and pp"
    parallel = parallel or Parallel()
    pp = parallel.pp
    if ranks != list(range(parallel.tp * pp)):
        return None, f"it holds the buckets of {len(ranks)} model-parallel ranks, but its args say tp x pp = {parallel.tp} x {pp}"
    if mtp_depths(model_keys) and pp > 1 and TIED_HEAD not in model_keys:  # megatron-core 0.16.1 saves none: unmeasured
        return None, f"its multi-token prediction block was saved at pp {pp} with a tied head, whose buckets dtgpt maps at pp 1 or untied only"
    if experts and parallel.etp not in (1, parallel.tp):
        return None, f"its experts are split over expert_tensor_parallel_size={parallel.etp} ranks at tp {parallel.tp}, which dtgpt does not map (only 1 or tp)"
    expert_stored = stored.get(1)
    expert_ranks = sorted(expert_stored or {})
    if 1 in stored and (expert_ranks != list(range(parallel.etp * parallel.ep * pp)) or experts % parallel.ep):
        return None, (f"it holds the experts' buckets of {len(expert_ranks)} model-parallel ranks, but its args say "
                      f"expert tp x ep x pp = {parallel.etp} x {parallel.ep} x {pp} for {experts} experts")  # fmt: skip
    # the first stage's first layer and the last stage's: in the last buckets of their ranks, which
    # megatron-core's buffer (reverse module order) fills last; of the experts, the first and the last
    checked_layers = {0, sum(parallel.stage_layers[:-1])}
    for name, spec in LAYER_SPECS.items():
        for module in EXPERT_ORDERS if experts else ("SequentialMLP",):
            pieces = rank_pieces(shapes, model_keys, spec, stored[0], parallel, module, expert_stored)
            checks = bucket_checks(pieces, checked_layers) + expert_checks(pieces, checked_layers, {0, experts - 1}) if pieces else []
            if pieces and agrees(directory, dtypes, checks, chunks):
                return BucketLayout(pieces, module if experts else ""), name
    what = ("GPT or MoE GPT, local or Transformer Engine spec, SequentialMLP or TEGroupedMLP experts" if experts else
            "dense GPT, local or Transformer Engine spec") + ", multi-head or multi-latent attention, MTP depths"  # fmt: skip
    return None, f"its buckets do not match megatron-core's parameter order for this model ({what})"
