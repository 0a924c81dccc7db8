"""The MoE router with Megatron's options: top-k over softmax or sigmoid scores, the expert bias
of aux-loss-free balancing, capacity and token dropping, and the load-balancing and z losses.

Plain single-device PyTorch. Tokens arrive flattened in Megatron's order, position-major
(token t of sample b is row t * B + b), so that what depends on order (the 'position' drop
policy, ties) is what Megatron does. Where a rank holds only a chunk of each sequence (tp under
sequence parallelism), dtgpt.parallel sets `sequence_ranks` and `sum_over_sequence_ranks`: the
losses then need the per-expert counts of the whole sequences, and each rank's loss is its
share, so the shares summed over those ranks are the one-process loss (as Megatron splits them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtgpt.config import ModelConfig
from dtgpt.inits import DeclaredInits, Init
from dtgpt.moe.forced_balance import forced_logits
from dtgpt.moe.group_routing import Select, plain_topk, topk_selector


ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
"""model.moe_router_dtype -> the dtype the router computes in."""


@dataclass
class Routing:
    """What the router decides for N tokens over E experts."""

    probs: torch.Tensor
    """(N, E) float: each token's weight for each expert it goes to, zero elsewhere."""
    routing_map: torch.Tensor
    """(N, E) bool: which experts each token goes to (after dropping; padding included)."""
    loss: torch.Tensor | None
    """The coefficient-weighted aux and z losses of this rank's tokens, whose gradient the layer
    adds in backward; None when there are none (or not training)."""
    logged: dict[str, torch.Tensor]
    """Megatron's logged names -> this rank's share of the loss without its coefficient."""
    dropped: torch.Tensor
    """How many (token, expert) choices the capacity dropped."""
    capacity: int | None = None
    """Tokens per expert when every expert is padded to its capacity (static shapes), else None."""
    topk: int | None = None
    """Experts per token when every token has exactly that many (dropless), else None."""


def top_k(
    logits: torch.Tensor, k: int, score_function: str, pre_softmax: bool, expert_bias: torch.Tensor | None,
    select: Select = plain_topk,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map), both (N, E): Megatron's top-k routing of the router's logits;
    `select` picks the top-k (dtgpt/moe/group_routing.py: group-limited or not)."""
    if score_function == "softmax":
        if pre_softmax:
            chosen, index = select(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits), k)
        else:
            chosen, index = select(logits, k)
            chosen = torch.softmax(chosen, dim=-1, dtype=torch.float32).type_as(logits)
    else:  # sigmoid; the expert bias moves the choice, never the weights
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            index = select(scores + expert_bias, k)[1]
            chosen = torch.gather(scores, 1, index)
        else:
            chosen, index = select(scores, k)
        if k > 1:
            chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    probs = torch.zeros_like(logits).scatter(1, index, chosen)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
    return probs, routing_map


def capacity(num_tokens: int, num_experts: int, k: int, factor: float) -> int:
    """Tokens an expert takes at most from a micro-batch: ceil(N * k / E * factor)."""
    return math.ceil(num_tokens * k / num_experts * factor)


def drop_over_capacity(
    probs: torch.Tensor, routing_map: torch.Tensor, k: int, factor: float, policy: str, pad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most `capacity` tokens per expert: its highest-probability ones ('probs') or, by
    Megatron's 'position' rule, the top-k of its 0/1 column (which the row order decides).
    With `pad`, every expert takes exactly its capacity (padding tokens carry probability 0)."""
    num_tokens, num_experts = probs.shape
    cap = capacity(num_tokens, num_experts, k, factor)
    if cap > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        ranked = probs if policy == "probs" else routing_map.int()
        index = torch.topk(ranked, cap, dim=0, sorted=False).indices
        keep = torch.zeros_like(routing_map).scatter(0, index, True)
    kept = keep if pad else routing_map & keep
    return probs * kept, kept


def aux_scores(logits: torch.Tensor, k: int, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, routing_map) the load-balancing loss reads: the score function over all experts
    (sigmoid normalised to sum 1), and its own top-k, before any bias or dropping."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    index = torch.topk(scores, k, dim=1).indices
    return scores, torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)


def switch_loss(score_sums: torch.Tensor, counts: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """The Switch load-balancing loss without its coefficient, E * sum_e f_e * P_e with
    f_e = counts_e / (k * tokens) and P_e = score_sums_e / tokens, summed over leading dims."""
    num_experts = score_sums.shape[-1]
    return (score_sums * counts).sum() * (num_experts / (k * tokens * tokens))


class Router(nn.Module):
    """Linear gate (E, h) -> top-k routing, capacity, and the auxiliary losses."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.num_experts
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(e)) if cfg.add_bias_linear else None  # as Megatron's router
        # fp32 whatever the compute dtype: a bf16 bias would stop moving once the steps fall
        # below its resolution. A buffer, so that the optimizer never touches it.
        self.register_buffer("expert_bias", torch.zeros(e) if cfg.moe_router_enable_expert_bias else None)
        self.sequence_ranks = 1
        self.sum_over_sequence_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda counts: counts
        self.forced_balance: tuple[int, str] | None = None
        """(seed, site) of model.moe_router_force_load_balancing's draws, and token_index (N,) the
        indices of the tokens of the next forward: set by dtgpt/moe/forced_balance.py."""
        self.token_index: torch.Tensor | None = None

    def init_buffers(self) -> None:
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free balancing: move each expert's bias by the update rate towards the mean
        load (up when below it), from the iteration's tokens per expert over every rank."""
        if self.expert_bias is None:
            return
        tokens = tokens_per_expert.to(self.expert_bias)
        self.expert_bias += torch.sign(tokens.mean() - tokens) * self.cfg.moe_router_bias_update_rate

    def forward(self, x: torch.Tensor, batch_size: int, weighted: bool) -> Routing:
        """x (N, h), N = positions * batch_size in position-major order; `weighted`: compute the
        losses that train (Megatron: only in training with gradients on)."""
        cfg = self.cfg
        logits = self.gating(x)
        if cfg.moe_router_force_load_balancing:
            logits = self._forced(logits)
        probs, routing_map = top_k(
            logits, cfg.moe_router_topk, cfg.moe_router_score_function, cfg.moe_router_pre_softmax, self.expert_bias,
            topk_selector(cfg),
        )  # fmt: skip
        if cfg.moe_router_topk_scaling_factor:
            probs = probs * cfg.moe_router_topk_scaling_factor
        dropped = torch.zeros((), dtype=torch.long, device=x.device)
        padded_capacity, exact_topk = None, cfg.moe_router_topk
        if cfg.moe_expert_capacity_factor is not None:
            exact_topk = None
            if cfg.moe_pad_expert_input_to_capacity:
                padded_capacity = capacity(x.shape[0], cfg.num_experts, cfg.moe_router_topk, cfg.moe_expert_capacity_factor)
            chosen = routing_map.sum()
            probs, routing_map = drop_over_capacity(
                probs, routing_map, cfg.moe_router_topk, cfg.moe_expert_capacity_factor,
                cfg.moe_token_drop_policy, cfg.moe_pad_expert_input_to_capacity,
            )  # fmt: skip
            dropped = (chosen - (routing_map & (probs > 0)).sum()).clamp(min=0)
        losses, logged = self._losses(logits, batch_size) if weighted else ([], {})
        loss = torch.stack([part.float() for part in losses]).sum() if losses else None
        return Routing(probs, routing_map, loss, logged, dropped, padded_capacity, exact_topk)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, h) -> logits (N, E) in moe_router_dtype (unset: x's dtype), as Megatron's gating:
        input, weight and bias cast to it, so that the gradients come back in their own dtypes."""
        dtype = ROUTER_DTYPES.get(self.cfg.moe_router_dtype, x.dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)

    def _forced(self, logits: torch.Tensor) -> torch.Tensor:
        if self.forced_balance is None or self.token_index is None or self.token_index.shape != logits.shape[:1]:
            raise ValueError(
                "model.moe_router_force_load_balancing: the router has no token indices for its tokens "
                "(dtgpt/moe/forced_balance.py apply_forced_balance gives them)"
            )
        return forced_logits(logits, *self.forced_balance, self.token_index)

    def _losses(self, logits: torch.Tensor, batch_size: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        cfg, losses, logged = self.cfg, [], {}
        kind, coeff, k = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_router_topk
        if kind != "none" and coeff > 0:
            scores, chosen = aux_scores(logits, k, cfg.moe_router_score_function)
            if kind == "aux_loss":
                counts = self.sum_over_sequence_ranks(chosen.sum(0))
                lb = switch_loss(scores.sum(0), counts, logits.shape[0] * self.sequence_ranks, k)
                name = "load_balancing_loss"
            else:  # per sequence: (positions, batch, E) summed over positions, then averaged
                scores, chosen = scores.view(-1, batch_size, scores.shape[-1]), chosen.view(-1, batch_size, chosen.shape[-1])
                counts = self.sum_over_sequence_ranks(chosen.sum(0))
                lb = switch_loss(scores.sum(0), counts, scores.shape[0] * self.sequence_ranks, k) / batch_size
                name = "seq_load_balancing_loss"
            losses.append(lb * coeff)
            logged[name] = lb.detach()
        if cfg.moe_z_loss_coeff is not None:
            # Each rank's mean over its tokens, shared out: the shares sum to the mean over all.
            z = torch.logsumexp(logits, dim=-1).square().mean() / self.sequence_ranks
            losses.append(z * cfg.moe_z_loss_coeff)
            logged["z_loss"] = z.detach()
        return losses, logged

    def declared_inits(self) -> DeclaredInits:
        return [(self.weight, Init.NORMAL)] + ([(self.bias, Init.NORMAL)] if self.bias is not None else [])
