"""Token dispatchers: route each token to its chosen experts and combine what they return.

A router gives, for N tokens and E experts, `routing_map` (N, E) bool (token n goes to expert e)
and `probs` (N, E). `dispatch` lays the routed (token, expert) pairs out sorted by expert (token
order within an expert, as Megatron's permutation does) and returns them with the count per
expert, the input dtgpt.moe.experts.GroupedExperts takes; `combine` takes the experts' outputs in
the same layout and returns, for each token, the sum over its experts of prob * output. The
probabilities are applied at combine (Megatron's default), so gradients reach both the tokens and
the probabilities. A dispatcher keeps the layout between the two calls, as Megatron's do.

Nothing here reads the routing on the host where the shapes are known (DESIGN invariant 10):
dropless (`topk`: every token goes to exactly topk experts) the N * topk pairs are found by
`nonzero_static`, and with `capacity` (Megatron's moe_pad_expert_input_to_capacity) each
expert's slots are filled by a sort, padded with zero rows to a fixed count, so that shapes do
not depend on the routing; the padding is never combined, so it gives no gradient. Only a
capacity that drops without padding (Megatron's variable-shape mode) counts its pairs on the
host, one `nonzero` per call. Dropping tokens over capacity is the router's business: the slots
take an expert's first `capacity` tokens and never check for more (a check would read the counts).

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
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


@dataclass
class _Layout:
    """Where each routed (token, expert) pair sits in the expert-sorted buffer."""

    token: torch.Tensor  # (P,) the pair's token, pairs sorted by expert then token
    filled: torch.Tensor | None  # (P,) bool: a real pair, not a padding slot; None: every row is one
    probs: torch.Tensor  # (P,) the pair's probability (zero in a padding slot)
    num_tokens: int
    counts_on_host: list[int] | None = None  # rows per (local) expert, where known without a sync


def _pairs(routing_map: torch.Tensor, topk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, token) of every routed pair, expert-major with tokens in order within each.

    With `topk` (every token routed to exactly topk experts: dropless) the pair count is N * topk,
    known on the host, and `nonzero_static` finds the pairs with no host sync; otherwise (a
    capacity that drops without padding) the count is the data's and `nonzero` reads it."""
    mask = routing_map.t()  # (E, N)
    if topk is None:
        expert, token = mask.nonzero(as_tuple=True)
        return expert, token
    flat = torch.nonzero_static(mask.reshape(-1), size=mask.shape[1] * topk).squeeze(1)
    return flat // mask.shape[1], flat % mask.shape[1]


def _slots(routing_map: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, token, filled), each (E * capacity,): expert e's slots hold its routed tokens in
    order, then padding (filled False, token 0). Static shapes: a sort, no host sync; tokens
    past an expert's capacity are left out (the router's capacity never sends them)."""
    num_tokens, num_experts = routing_map.shape
    position = torch.arange(num_tokens, device=routing_map.device)
    key = torch.where(routing_map.t(), position, num_tokens + position)  # (E, N): routed first, in order
    slots = key.sort(dim=1).values[:, :capacity]
    if slots.shape[1] < capacity:  # a capacity over the token count: the rest is padding
        slots = F.pad(slots, (0, capacity - num_tokens), value=num_tokens)
    filled = (slots < num_tokens).reshape(-1)
    expert = torch.arange(num_experts, device=routing_map.device).repeat_interleave(capacity)
    return expert, torch.where(filled, slots.reshape(-1), 0), filled


def _permute(
    x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, capacity: int | None, topk: int | None
) -> tuple[torch.Tensor, torch.Tensor, _Layout]:
    """x (N, h) -> (buffer (P or E * capacity, h) sorted by expert, tokens per expert (E,), layout)."""
    if routing_map.dtype != torch.bool or routing_map.shape != probs.shape or routing_map.shape[0] != x.shape[0]:
        raise ValueError(
            f"routing_map {tuple(routing_map.shape)} {routing_map.dtype} must be bool, shaped as probs "
            f"{tuple(probs.shape)} with one row per token of x {tuple(x.shape)}"
        )
    num_experts = routing_map.shape[1]
    if capacity is None:
        expert, token = _pairs(routing_map, topk)
        layout = _Layout(token=token, filled=None, probs=probs[token, expert], num_tokens=x.shape[0])
        return x.index_select(0, token), routing_map.sum(0), layout
    expert, token, filled = _slots(routing_map, capacity)
    # A flat gather, not probs[token, expert]: compiled by inductor (torch 2.13, CPU), the 2-D
    # index's backward (padding slots repeat (0, e)) lost the router's gradient through the
    # probabilities (aot_eager was right); the gather's scatter-add backward is right in both.
    pair_probs = torch.where(filled, probs.reshape(-1).gather(0, token * num_experts + expert), 0)
    layout = _Layout(token, filled, pair_probs, x.shape[0], counts_on_host=[capacity] * num_experts)
    buffer = torch.where(filled.unsqueeze(-1), x.index_select(0, token), 0)  # padding rows are zeros
    counts = torch.full((num_experts,), capacity, dtype=torch.long, device=x.device)
    return buffer, counts, layout


def _unpermute(y: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The expert-sorted outputs y -> (N, h): each token's sum of prob * output over its experts.
    Padding slots add exact zeros (their outputs are masked, never read, whatever they hold)."""
    if layout.filled is not None:
        y = torch.where(layout.filled.unsqueeze(-1), y, 0)
    weighted = y * layout.probs.unsqueeze(-1)  # in the promoted dtype (the router's), as Megatron
    out = weighted.new_zeros(layout.num_tokens, y.shape[1]).index_add(0, layout.token, weighted)
    return out.to(y.dtype)


class LocalDispatcher:
    """Every expert on this rank: dispatch is a permutation, combine its weighted inverse."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._layout: _Layout | None = None

    def dispatch(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, *, capacity: int | None = None, topk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, h), probs (N, E), routing_map (N, E) bool -> (x_sorted (M, h), tokens_per_expert (E,)).

        capacity: pad every expert's rows to it (static shapes); topk: every token is routed to
        exactly topk experts (dropless), so that the pairs are found without a host sync."""
        _check_experts(routing_map, self.num_experts)
        x_sorted, counts, self._layout = _permute(x, probs, routing_map, capacity, topk)
        return x_sorted, counts

    @property
    def counts_on_host(self) -> list[int] | None:
        """The last dispatch's rows per expert where the host knows them without a sync (capacity)."""
        return self._layout.counts_on_host if self._layout is not None else None

    def combine(self, y_sorted: torch.Tensor) -> torch.Tensor:
        """y_sorted (M, h), in dispatch's layout -> (N, h)."""
        return _unpermute(y_sorted, _take(self))


class AllToAllDispatcher:
    """Experts spread over `group` (expert parallelism): tokens travel to their experts' rank and back.

    With a capacity every rank sends every other rank exactly capacity rows per expert: the
    exchange's sizes are known on the host and nothing syncs. Dropless, the sizes are the
    routing's: the ranks exchange their counts per expert, and one copy of the split sizes (and
    of the local experts' counts) to the host follows per layer and micro-batch, which the token
    exchange needs before it starts (as Megatron's dropless all-to-all dispatcher)."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup):
        self.ep = dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the expert-parallel size {self.ep}")
        self.num_experts, self.group = num_experts, group
        self.local_experts = num_experts // self.ep
        self._layout: _Layout | None = None

    def dispatch(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, *, capacity: int | None = None, topk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, h) of this rank's tokens -> (the tokens this rank's experts received, sorted by
        local expert (M, h), tokens_per_local_expert (E / ep,)); capacity and topk as LocalDispatcher's
        (capacity must be the same on every rank)."""
        _check_experts(routing_map, self.num_experts)
        sent, counts, layout = _permute(x, probs, routing_map, capacity, topk)
        if capacity is not None:
            self._layout, self._exchange = layout, None
            tokens = all_to_all_single_autograd(sent, None, None, self.group)
            # Received in (source rank, local expert) blocks of capacity rows; experts want (local expert, source rank).
            h = tokens.shape[-1]
            tokens = tokens.view(self.ep, self.local_experts, capacity, h).transpose(0, 1).reshape(-1, h)
            layout.counts_on_host = [self.ep * capacity] * self.local_experts
            return tokens, torch.full((self.local_experts,), self.ep * capacity, dtype=torch.long, device=x.device)
        received = torch.empty_like(counts)  # (ep * E_local,): [source rank, local expert]
        dist.all_to_all_single(received, counts, group=self.group)
        by_rank = received.view(self.ep, -1)
        # The token exchange's sizes must be on the host: one copy per layer, as Megatron's.
        sizes = torch.cat([counts.view(self.ep, -1).sum(1), by_rank.sum(1), by_rank.sum(0)]).tolist()
        send_splits, recv_splits, layout.counts_on_host = sizes[: self.ep], sizes[self.ep : 2 * self.ep], sizes[2 * self.ep :]
        tokens = all_to_all_single_autograd(sent, recv_splits, send_splits, self.group)
        expert = torch.arange(self.local_experts, device=x.device).repeat(self.ep)
        order = torch.repeat_interleave(expert, received, output_size=sum(recv_splits)).argsort(stable=True)
        self._layout = layout
        self._exchange = (send_splits, recv_splits, order)
        return tokens.index_select(0, order), by_rank.sum(0)

    @property
    def counts_on_host(self) -> list[int] | None:
        """The last dispatch's rows per local expert, on the host (the capacity's, or the exchanged sizes)."""
        return self._layout.counts_on_host if self._layout is not None else None

    def combine(self, y_sorted: torch.Tensor) -> torch.Tensor:
        """y_sorted (M, h), in dispatch's layout -> (N, h) for this rank's tokens."""
        layout = _take(self)
        if self._exchange is None:  # capacity: back from (local expert, source rank) to (source rank, local expert)
            h = y_sorted.shape[-1]
            y = y_sorted.view(self.local_experts, self.ep, -1, h).transpose(0, 1).reshape(-1, h)
            return _unpermute(all_to_all_single_autograd(y, None, None, self.group), layout)
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
