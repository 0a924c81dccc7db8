"""Token dispatchers: route each token to its chosen experts and combine what they return.

A router gives, for N tokens and E experts, `routing_map` (N, E) bool (token n goes to expert e)
and `probs` (N, E). `dispatch` lays the routed (token, expert) pairs out sorted by expert (token
order within an expert, as Megatron's permutation does) and returns them with the count per
expert, the input dtgpt.moe.experts.GroupedExperts takes; `combine` takes the experts' outputs in
the same layout and returns, for each token, the sum over its experts of prob * output. The
probabilities are applied at combine (Megatron's default), so gradients reach both the tokens and
the probabilities. A dispatcher keeps the layout between the two calls, as Megatron's do.

`capacity` (Megatron's moe_pad_expert_input_to_capacity) pads each expert's rows with zeros to a
fixed count, so that shapes do not depend on the routing; the padded rows are never combined, so
they give no gradient. Dropping tokens over capacity is the router's business: an expert sent
more than `capacity` tokens is an error here.

LocalDispatcher keeps every expert on this rank. AllToAllDispatcher spreads them over an
expert-parallel group (rank r holds experts [r * E / ep, (r + 1) * E / ep)): each rank permutes
its own tokens, the ranks exchange their counts and then the tokens with all_to_all_single
(torch's autograd-aware functional collective carries the gradients back), and each rank returns
the tokens it received sorted by its local expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


@dataclass
class _Layout:
    """Where each routed (token, expert) pair sits in the expert-sorted buffer."""

    token: torch.Tensor  # (P,) the pair's token, pairs sorted by expert then token
    row: torch.Tensor | None  # (P,) its row in the padded buffer; None: row i is pair i
    probs: torch.Tensor  # (P,) the pair's probability
    num_tokens: int


def _permute(
    x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, _Layout]:
    """x (N, h) -> (buffer (P or E * capacity, h) sorted by expert, tokens per expert (E,), layout)."""
    if routing_map.dtype != torch.bool or routing_map.shape != probs.shape or routing_map.shape[0] != x.shape[0]:
        raise ValueError(
            f"routing_map {tuple(routing_map.shape)} {routing_map.dtype} must be bool, shaped as probs "
            f"{tuple(probs.shape)} with one row per token of x {tuple(x.shape)}"
        )
    expert, token = routing_map.t().nonzero(as_tuple=True)  # expert-major, tokens in order within each
    counts = routing_map.sum(0)  # (E,) int64
    layout = _Layout(token=token, row=None, probs=probs[token, expert], num_tokens=x.shape[0])
    rows = x.index_select(0, token)  # (P, h)
    if capacity is None:
        return rows, counts, layout
    most = int(counts.max()) if counts.numel() else 0
    if most > capacity:
        raise ValueError(f"an expert was sent {most} tokens, over its capacity {capacity}: the router drops the excess")
    first = counts.cumsum(0) - counts  # each expert's first pair
    layout.row = expert * capacity + torch.arange(token.numel(), device=x.device) - first[expert]
    buffer = x.new_zeros(counts.numel() * capacity, x.shape[1]).index_copy(0, layout.row, rows)
    return buffer, torch.full_like(counts, capacity), layout


def _unpermute(y: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The expert-sorted outputs y -> (N, h): each token's sum of prob * output over its experts."""
    pairs = y if layout.row is None else y.index_select(0, layout.row)
    weighted = pairs * layout.probs.unsqueeze(-1)  # in the promoted dtype (fp32 probs), as Megatron
    out = weighted.new_zeros(layout.num_tokens, y.shape[1]).index_add(0, layout.token, weighted)
    return out.to(y.dtype)


class LocalDispatcher:
    """Every expert on this rank: dispatch is a permutation, combine its weighted inverse."""

    def __init__(self, num_experts: int, capacity: int | None = None):
        self.num_experts, self.capacity = num_experts, capacity
        self._layout: _Layout | None = None

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, h), probs (N, E), routing_map (N, E) bool -> (x_sorted (M, h), tokens_per_expert (E,))."""
        _check_experts(routing_map, self.num_experts)
        x_sorted, counts, self._layout = _permute(x, probs, routing_map, self.capacity)
        return x_sorted, counts

    def combine(self, y_sorted: torch.Tensor) -> torch.Tensor:
        """y_sorted (M, h), in dispatch's layout -> (N, h)."""
        return _unpermute(y_sorted, _take(self))


class AllToAllDispatcher:
    """Experts spread over `group` (expert parallelism): tokens travel to their experts' rank and back."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup, capacity: int | None = None):
        self.ep = dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the expert-parallel size {self.ep}")
        self.num_experts, self.group, self.capacity = num_experts, group, capacity
        self.local_experts = num_experts // self.ep
        self._layout: _Layout | None = None

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, h) of this rank's tokens -> (the tokens this rank's experts received, sorted by
        local expert (M, h), tokens_per_local_expert (E / ep,))."""
        _check_experts(routing_map, self.num_experts)
        sent, counts, layout = _permute(x, probs, routing_map, self.capacity)
        received = torch.empty_like(counts)  # (ep * E_local,): [source rank, local expert]
        dist.all_to_all_single(received, counts, group=self.group)
        # The token exchange's sizes must be on the host (one sync per layer, as Megatron's).
        send_splits = counts.view(self.ep, -1).sum(1).tolist()
        recv_splits = received.view(self.ep, -1).sum(1).tolist()
        tokens = all_to_all_single_autograd(sent, recv_splits, send_splits, self.group)
        # Received in (source rank, local expert) blocks; the experts want (local expert, source rank).
        expert = torch.arange(self.local_experts, device=x.device).repeat(self.ep)
        order = torch.repeat_interleave(expert, received, output_size=sum(recv_splits)).argsort(stable=True)
        self._layout = layout
        self._exchange = (send_splits, recv_splits, order)
        return tokens.index_select(0, order), received.view(self.ep, -1).sum(0)

    def combine(self, y_sorted: torch.Tensor) -> torch.Tensor:
        """y_sorted (M, h), in dispatch's layout -> (N, h) for this rank's tokens."""
        layout = _take(self)
        send_splits, recv_splits, order = self._exchange
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        returned = all_to_all_single_autograd(y_sorted.index_select(0, back), send_splits, recv_splits, self.group)
        return _unpermute(returned, layout)


def _check_experts(routing_map: torch.Tensor, num_experts: int) -> None:
    if routing_map.dim() != 2 or routing_map.shape[1] != num_experts:
        raise ValueError(f"routing_map {tuple(routing_map.shape)} must be (tokens, {num_experts} experts)")


def _take(dispatcher) -> _Layout:
    """The layout of the last dispatch, used once: a combine must follow its own dispatch."""
    layout, dispatcher._layout = dispatcher._layout, None
    if layout is None:
        raise RuntimeError(f"{type(dispatcher).__name__}.combine() without a dispatch() before it")
    return layout
