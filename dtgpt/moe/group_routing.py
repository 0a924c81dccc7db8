"""Group-limited top-k (DeepSeek-V2/V3's device- and node-limited routing), as Megatron-Core
chooses: the experts fall into moe_router_num_groups equal groups; a token scores each group by
the sum of its top (k / moe_router_group_topk) expert scores, keeps the best
moe_router_group_topk groups, and takes its top-k experts among theirs only.

Plain single-device PyTorch, called by dtgpt/moe/router.py's top_k in place of torch.topk.
"""

from __future__ import annotations

from typing import Callable

import torch

from dtgpt.config import ModelConfig

Select = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""(scores (N, E), k) -> (the chosen scores, their expert indices), both (N, k)."""


def plain_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(scores, k, dim=1)
    return values, indices


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int, group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = scores.shape
    per_group = scores.view(tokens, num_groups, experts // num_groups)  # (N, G, E/G)
    group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(dim=-1)  # (N, G)
    groups = torch.topk(group_scores, group_topk, dim=-1, sorted=False).indices
    chosen_groups = torch.zeros_like(group_scores).scatter(1, groups, 1).bool()  # (N, G)
    allowed = chosen_groups.unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)
    values, indices = torch.topk(scores.masked_fill(~allowed, float("-inf")), k, dim=-1)
    return values, indices


def topk_selector(cfg: ModelConfig) -> Select:
    """How the router picks its top-k: group-limited with moe_router_group_topk, else torch.topk."""
    if not cfg.moe_router_group_topk:
        return plain_topk
    groups, group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    return lambda scores, k: group_limited_topk(scores, k, groups, group_topk)
