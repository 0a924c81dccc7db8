"""An MoE model's routed experts in megatron-core's dp_reshardable buckets (the rest: buckets.py).

megatron-core keeps the routed experts' weights (linear_fc1, linear_fc2 of each expert) where the
data-parallel group they are reduced over says:
- at ep 1 they are not expert-parallel: the dense grad buffer of each tp rank holds them, in the
  layer's module order (after the router, before the shared expert), and there is one optimizer
  (keys unprefixed);
- at ep > 1 they have an optimizer of their own, over the expert-data-parallel group: the dense
  buffers are `chained_0.`, the experts' `chained_1.`, whose model-parallel rank <M> is the rank in
  megatron-core's expert tp x ep x pp group (its rank generator's 'tp-ep-pp', tp fastest):
  expert tp rank + etp x (ep rank + ep x pp rank). That rank's buffer holds its stage's layers'
  local experts (global expert ep rank x E / ep + k for local k); with virtual pipeline stages it
  holds a buffer per model chunk (gbuf_idx c: virtual stage c x pp + pp rank, as the dense
  buffers; megatron-core buckets chunk 0 of pp rank 0 alone, the stored lengths say so).
Either way each expert's tensors are whole at expert tp (etp) 1 (at ep 1 each tp rank's buffer
keeps a copy: tp rank 0's is read), or at etp = tp split as the dense MLP's (EXPERT_TP_DIM: fc1 rows, SwiGLU's
as [gate shard; up shard], fc2 columns) over the expert tp ranks. Megatron's default is etp = tp;
other etp are not mapped. The router and the shared expert's gate are whole on every tp rank, the
shared expert split as the dense MLP (layer_orders.TP_DIM).
Within a layer the experts follow their module's parameter order (EXPERT_ORDERS): SequentialMLP
keeps one MLP per expert (fc1, then fc2), TEGroupedMLP one grouped linear per projection (every
expert's fc1, then every expert's fc2). Both are tried, as the layer specs are. The stored tensor
is the same whichever module saved it: (layers, E, rows, cols), so an expert's state is a block
(1, rows, cols) at (e, 0, 0) of one layer's, or at etp > 1 its shards' blocks. GroupedMLP (one stacked, transposed weight per
projection) fits neither: no layout, fresh moments.
"""

from __future__ import annotations

from typing import NamedTuple

from dtgpt.checkpoint.megatron.bucket_blocks import KeyBlock, generic, in_checked_block

EXPERTS = "mlp.experts.experts"
"""Where a layer spec's order (layer_orders.LAYER_SPECS) places the layer's routed experts."""
EXPERT_PREFIX = "decoder.layers.mlp.experts.experts."
_PROJECTIONS = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
EXPERT_ORDERS = {
    "SequentialMLP": lambda experts: [(name, e) for e in experts for name in _PROJECTIONS],
    "TEGroupedMLP": lambda experts: [(name, e) for name in _PROJECTIONS for e in experts],
}
"""(tensor, expert) of one layer's experts in megatron-core's parameter order, by expert module."""
EXPERT_TP_DIM = {EXPERT_PREFIX + "linear_fc1.weight": 0, EXPERT_PREFIX + "linear_fc1.bias": 0, EXPERT_PREFIX + "linear_fc2.weight": 1}
"""The dimension of one expert's tensor that megatron-core splits over expert tp ranks (etp > 1)."""


class ExpertSplit(NamedTuple):
    """The global experts a grad buffer holds of each of its layers, and their module's order."""

    experts: range
    module: str
    tp: int = 1  # the expert tp size (etp): each expert's tensors split over that many ranks
    tp_rank: int = 0  # which of them this buffer belongs to (in an experts' own buffer)


def is_expert_key(key: str) -> bool:
    """A routed expert's tensor, of a stacked or a lone block (bucket_blocks.py)."""
    return generic(key).startswith(EXPERT_PREFIX)


def num_experts(shapes: dict, model_keys: list[str]) -> int:
    """The routed experts per layer (0: not an MoE checkpoint): (L, E, ...) stacked, (E, ...) alone."""
    return next((shapes[k][1 if k.startswith(EXPERT_PREFIX) else 0] for k in model_keys if is_expert_key(k)), 0)


def expert_entries(shapes: dict, model_keys: list[str], block: KeyBlock, split: ExpertSplit) -> list[tuple[tuple, tuple[int, ...]]]:
    """((key, layer, expert), one expert's shape) of `block`'s experts in `split`, in order."""
    keys = [(block.prefix + EXPERTS + "." + name, e) for name, e in EXPERT_ORDERS[split.module](split.experts)]
    skip = 2 if block.layer is not None else 1  # the layer and expert axes
    return [((key, block.layer, e), expert_shape(key, shapes[key][skip:], split.tp)) for key, e in keys if key in model_keys]


def expert_shape(key: str, shape: tuple[int, ...], etp: int) -> tuple[int, ...]:
    """One expert's tensor of global `shape` on one of `etp` expert tp ranks."""
    dim = EXPERT_TP_DIM.get(generic(key)) if etp > 1 else None
    return shape if dim is None else tuple(n // etp if d == dim else n for d, n in enumerate(shape))


def rank_split(rank: int, ep: int, experts: int, module: str, etp: int = 1) -> tuple[int, ExpertSplit]:
    """(pp rank, experts) of the experts' buffers of expert model-parallel rank `rank`."""
    per_rank = experts // ep
    tp_rank, rest = rank % etp, rank // etp
    pp_rank, ep_rank = divmod(rest, ep)
    return pp_rank, ExpertSplit(range(ep_rank * per_rank, (ep_rank + 1) * per_rank), module, etp, tp_rank)


Check = tuple[tuple, tuple]


def expert_checks(pieces: dict, checked_layers: set[int], checked_experts: set[int]) -> list[Check]:
    """The first row of each block (a tp shard, a SwiGLU half) of each expert tensor of
    `checked_experts` in `checked_layers`, each against its run of its bucket (buckets.agrees).
    Bounded whatever E, ep and the layer count: at most 4 x 2 etp x len(checked_experts) x
    (len(checked_layers) + MTP depths) rows. The first and the last expert lie in
    other buffers at ep > 1 and far apart at ep 1, so a wrong start, expert order or expert
    numbering moves a checked row onto other elements."""
    checks = []
    for (key, layer), found in pieces.items():
        if not is_expert_key(key) or not in_checked_block(key, layer, checked_layers):
            continue
        at = () if layer is None else (layer,)
        for piece in found:
            if piece.offsets[0] in checked_experts:
                row = piece.shape[-1]
                weight = (key, (*at, *piece.offsets), (*(1,) * len(at), *(1,) * (len(piece.shape) - 1), row))
                checks.append((weight, (f"{piece.prefix}.param", (piece.start,), (row,))))
    return checks
