"""An MoE model's routed experts in megatron-core's dp_reshardable buckets (the rest: buckets.py).

megatron-core keeps the routed experts' weights (linear_fc1, linear_fc2 of each expert) where the
data-parallel group they are reduced over says:
- at ep 1 they are not expert-parallel: the dense grad buffer holds them, in the layer's module
  order (after the router, before the shared expert), and there is one optimizer (keys unprefixed);
- at ep > 1 they have an optimizer of their own, over the expert-data-parallel group: the dense
  buffers are `chained_0.`, the experts' `chained_1.`, whose model-parallel rank <M> is the rank in
  megatron-core's expert tp x ep x pp group (its rank generator's 'tp-ep-pp', tp fastest): at
  expert tp 1, ep rank + ep x pp rank. That rank's buffer holds its stage's layers' local experts
  (global expert ep rank x E / ep + k for local k), each expert's tensors whole.
Within a layer the experts follow their module's parameter order (EXPERT_ORDERS): SequentialMLP
keeps one MLP per expert (fc1, then fc2), TEGroupedMLP one grouped linear per projection (every
expert's fc1, then every expert's fc2). Both are tried, as the layer specs are. The stored tensor
is the same whichever module saved it: (layers, E, rows, cols), so an expert's state is a block
(1, rows, cols) at (e, 0, 0) of one layer's. GroupedMLP (one stacked, transposed weight per
projection) fits neither: no layout, fresh moments.
"""

from __future__ import annotations

from typing import NamedTuple

EXPERTS = "mlp.experts.experts"
"""Where a layer order (buckets.LAYER_ORDERS) places the layer's routed experts."""
EXPERT_PREFIX = "decoder.layers.mlp.experts.experts."
_PROJECTIONS = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
EXPERT_ORDERS = {
    "SequentialMLP": lambda experts: [(name, e) for e in experts for name in _PROJECTIONS],
    "TEGroupedMLP": lambda experts: [(name, e) for name in _PROJECTIONS for e in experts],
}
"""(tensor, expert) of one layer's experts in megatron-core's parameter order, by expert module."""


class ExpertSplit(NamedTuple):
    """The global experts a grad buffer holds of each of its layers, and their module's order."""

    experts: range
    module: str


def is_expert_key(key: str) -> bool:
    return key.startswith(EXPERT_PREFIX)


def num_experts(shapes: dict, model_keys: list[str]) -> int:
    """The routed experts per layer (0: not an MoE checkpoint, or one keeping its layers apart)."""
    return next((shapes[k][1] for k in model_keys if is_expert_key(k)), 0)


def expert_entries(shapes: dict, model_keys: list[str], layer: int, split: ExpertSplit) -> list[tuple[tuple, tuple[int, ...]]]:
    """((key, layer, expert), one expert's shape) of layer `layer`'s experts in `split`, in order."""
    keys = [(EXPERT_PREFIX + name, e) for name, e in EXPERT_ORDERS[split.module](split.experts)]
    return [((key, layer, e), shapes[key][2:]) for key, e in keys if key in model_keys]


def rank_split(rank: int, ep: int, experts: int, module: str) -> tuple[int, ExpertSplit]:
    """(pipeline stage, experts) of the experts' buffer of model-parallel rank `rank` (expert tp 1)."""
    per_rank = experts // ep
    stage, ep_rank = divmod(rank, ep)
    return stage, ExpertSplit(range(ep_rank * per_rank, (ep_rank + 1) * per_rank), module)


Check = tuple[tuple, tuple]


def expert_checks(pieces: dict, checked_layers: set[int], checked_experts: set[int]) -> list[Check]:
    """The first row of each expert tensor of `checked_experts` in `checked_layers`, each against
    its run of its bucket (buckets.agrees). Bounded whatever E, ep and the layer count: at most
    4 x len(checked_experts) x len(checked_layers) rows. The first and the last expert lie in
    other buffers at ep > 1 and far apart at ep 1, so a wrong start, expert order or expert
    numbering moves a checked row onto other elements."""
    checks = []
    for (key, layer), found in pieces.items():
        if not is_expert_key(key) or layer not in checked_layers:
            continue
        for piece in found:
            if piece.offsets[0] in checked_experts:
                row = piece.shape[-1]
                weight = (key, (layer, *piece.offsets), (1, *(1,) * (len(piece.shape) - 1), row))
                checks.append((weight, (f"{piece.prefix}.param", (piece.start,), (row,))))
    return checks
