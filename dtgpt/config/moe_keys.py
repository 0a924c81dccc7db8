"""The mixture-of-experts keys of [model], with Megatron-LM's names, defaults and meanings.

A base of ModelConfig (dtgpt/config/sections.py) so that [model] stays one section, as in
Megatron's args; its rules are dtgpt/config/moe_rules.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dtgpt.config.layer_freq import moe_layer_pattern


@dataclass
class MoEKeys:
    num_experts: Optional[int] = None
    """Experts per MoE layer; unset: every block has a dense MLP."""
    moe_ffn_hidden_size: Optional[int] = None
    """Each expert's MLP width; unset: the dense width (ffn_hidden_size)."""
    moe_router_topk: int = 2
    """Experts each token is sent to."""
    moe_layer_freq: int | str = 1
    """Block i (from 0) is an MoE layer when i % moe_layer_freq == 0, the others dense; or
    Megatron's per-block list of 0/1 as text, e.g. "([0]*3+[1]*58)" (dtgpt/config/layer_freq.py)."""
    moe_router_score_function: str = "softmax"
    """'softmax' or 'sigmoid' over the router's logits."""
    moe_router_pre_softmax: bool = False
    """softmax: take the top-k of the softmax over all experts (else the softmax of the top-k logits)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """'aux_loss' (the Switch loss over each micro-batch), 'seq_aux_loss' (per sequence, averaged)
    or 'none'."""
    moe_aux_loss_coeff: float = 0.0
    """The load-balancing loss's weight (0: none)."""
    moe_z_loss_coeff: Optional[float] = None
    """The router z-loss's weight, mean(logsumexp(logits)^2) (unset: none)."""
    moe_router_dtype: Optional[str] = None
    """The router's precision: its logits, scores and routing probabilities, and the combine's
    weighting, computed in 'fp32' or 'fp64'; unset: the compute dtype."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice only,
    moved by moe_router_bias_update_rate towards the mean load after every iteration (sigmoid only)."""
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: Optional[float] = None
    """Each expert takes at most ceil(tokens * topk / num_experts * factor) tokens of a
    micro-batch; unset: dropless."""
    moe_token_drop_policy: str = "probs"
    """Over capacity, keep an expert's highest-probability tokens ('probs') or its earliest
    positions ('position')."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor, every expert runs exactly its capacity of tokens."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: the experts in this many equal groups (DeepSeek's devices or nodes)."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: each token picks this many groups, by the sum of its top
    (moe_router_topk / moe_router_group_topk) scores in each, then its top-k experts within them."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """The routed experts' weights are multiplied by this (DeepSeek-V3: 2.5); unset: 1."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of an MLP every token also goes through (the shared expert); unset: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a learned gate, sigmoid(x . w) per token (Qwen2-MoE's;
    w is one row of hidden_size, replicated over tp like the router)."""
    moe_grouped_gemm: bool = False
    """Run the experts as grouped matrix multiplications (torch._grouped_mm), not one by one."""
    moe_router_force_load_balancing: bool = False
    """Benchmarking only, as Megatron's: the router's logits are replaced by standard normal draws
    (the gradient passes straight through to the real ones), so every expert gets about the same
    load; dtgpt draws each (token, expert) value from a hash of the seed, the layer and the
    token's index in the run, the same in every layout (dtgpt/moe/forced_balance.py)."""
    moe_per_layer_logging: bool = False
    """Also log each MoE layer's router losses (Megatron's tags `moe/<loss>_layer_<i>`, in the
    metrics file and tensorboard); the routing statistics' one all-reduce gets longer, no more."""
    moe_token_dispatcher_type: str = "allgather"
    """How Megatron moves tokens to their experts ('allgather', 'alltoall' or 'flex'): the same
    result in each (docs/moe.md), so it only decides which of Megatron's rules apply (flex with
    DeepEP cannot pad to capacity)."""
    moe_enable_deepep: bool = False
    """Megatron's older spelling of moe_flex_dispatcher_backend='deepep' (needs the flex dispatcher)."""
    moe_flex_dispatcher_backend: str = "deepep"
    """The flex dispatcher's kernels ('deepep', 'hybridep' or 'ncclep'): transport only."""

    @property
    def moe_enabled(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` (0-based, global) holds an MoE layer instead of the dense MLP."""
        return self.moe_enabled and moe_layer_pattern(self.moe_layer_freq, self.num_layers)[index]
