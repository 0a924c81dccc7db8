"""The rules of the mixture-of-experts keys ([model] num_experts, moe_*; [parallel]
expert_model_parallel_size): check_moe needs no world size, check_expert_mesh needs it."""

from __future__ import annotations

from dtgpt.config.layer_freq import moe_layer_pattern
from dtgpt.config.sections import Config, ConfigError
from dtgpt.config.sections import require as _require

MOE_CHOICES = {
    "model.moe_router_score_function": ("softmax", "sigmoid"),
    "model.moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "none"),
    "model.moe_token_drop_policy": ("probs", "position"),
    "model.moe_router_dtype": (None, "fp32", "fp64"),
    "model.moe_token_dispatcher_type": ("allgather", "alltoall", "flex"),
    "model.moe_flex_dispatcher_backend": ("deepep", "hybridep", "ncclep"),
}


def check_moe(cfg: Config) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    etp = p.expert_tensor_parallel_size
    _require(
        etp in (None, 1),
        f"parallel.expert_tensor_parallel_size={etp}: only 1 is built (each expert is kept whole on every tensor-parallel "
        "rank; the model is the same, only Megatron's layout of the expert weights differs); set 1 or leave it unset",
    )
    ep = p.expert_model_parallel_size
    _require(ep >= 1, f"parallel.expert_model_parallel_size={ep} must be >= 1")
    _require(
        not m.moe_shared_expert_gate or (m.moe_enabled and m.moe_shared_expert_intermediate_size),
        "model.moe_shared_expert_gate=true needs model.num_experts and model.moe_shared_expert_intermediate_size "
        f"(got {m.num_experts} and {m.moe_shared_expert_intermediate_size}): it gates the shared expert's output",
    )
    if not m.moe_enabled:
        _require(
            ep == 1,
            f"parallel.expert_model_parallel_size={ep} needs model.num_experts (expert parallelism splits experts)",
        )
        return
    e, k = m.num_experts, m.moe_router_topk
    _require(e >= 1, f"model.num_experts={e} must be >= 1 (or unset for a dense model)")
    _require(1 <= k <= e, f"model.moe_router_topk={k} must be in [1, model.num_experts={e}]")
    _require(
        k > 1 or m.moe_router_score_function != "softmax" or m.moe_router_pre_softmax,
        "model.moe_router_topk=1 with model.moe_router_score_function='softmax' needs model.moe_router_pre_softmax=true "
        "(a softmax over the one chosen logit is always 1: the router would never learn), as in Megatron",
    )
    try:
        moe_layer_pattern(m.moe_layer_freq, m.num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_group_routing(m)
    check_dispatcher(m)
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(m, key)
        _require(value is None or value > 0, f"model.{key}={value} must be > 0 (or unset)")
    _require(m.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} must be >= 0")
    z = m.moe_z_loss_coeff
    _require(z is None or z >= 0, f"model.moe_z_loss_coeff={z} must be >= 0 (or unset)")
    _require(
        not m.moe_router_enable_expert_bias or m.moe_router_score_function == "sigmoid",
        "model.moe_router_enable_expert_bias=true needs model.moe_router_score_function='sigmoid' "
        f"(got {m.moe_router_score_function!r}), as in Megatron",
    )
    rate = m.moe_router_bias_update_rate
    _require(rate >= 0, f"model.moe_router_bias_update_rate={rate} must be >= 0")
    factor = m.moe_expert_capacity_factor
    _require(factor is None or factor > 0, f"model.moe_expert_capacity_factor={factor} must be > 0 (or unset: dropless)")
    _require(
        factor is not None or not m.moe_pad_expert_input_to_capacity,
        "model.moe_pad_expert_input_to_capacity=true needs model.moe_expert_capacity_factor",
    )
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    _require(
        tp == 1 or p.sequence_parallel,
        f"model.num_experts={e} with parallel.tensor_model_parallel_size={tp} needs parallel.sequence_parallel=true "
        "(as Megatron: each tp rank routes its own sequence chunk)",
    )
    shared = m.moe_shared_expert_intermediate_size
    _require(
        shared is None or shared % tp == 0,
        f"parallel.tensor_model_parallel_size={tp} must divide model.moe_shared_expert_intermediate_size={shared} "
        "(the shared expert is split over tp like the dense MLP)",
    )
    _require(
        factor is None or (tp == 1 and cp == 1),
        f"model.moe_expert_capacity_factor={factor} needs tensor_model_parallel_size=1 and context_parallel_size=1 "
        f"(got {tp} and {cp}): capacity is counted over the tokens a rank holds, so which tokens drop would "
        "depend on how sequences are split",
    )
    _require(
        not t.compile or not m.moe_grouped_gemm,
        f"training.compile=true is not supported with model.moe_grouped_gemm=true (model.num_experts={e}): "
        "torch 2.13's torch._grouped_mm has no fp32 or fp16 meta kernel for the compiler; set training.compile=false "
        "or model.moe_grouped_gemm=false",
    )
    _require(
        not t.compile or tp == 1,
        f"training.compile=true is not supported with model.num_experts={e} under parallel.tensor_model_parallel_size={tp}: "
        "no parity test covers compiled MoE blocks under tp (each MoE layer an FSDP unit inside its block); "
        "set training.compile=false",
    )
    _require(
        not t.compile or not m.moe_router_force_load_balancing,
        "training.compile=true is not supported with model.moe_router_force_load_balancing=true (a benchmarking "
        "mode whose token indices reach the routers by a hook on each block, which no compiled test covers); "
        "set training.compile=false",
    )
    _require(e % ep == 0, f"parallel.expert_model_parallel_size={ep} must divide model.num_experts={e}")
    if p.data_parallel_shard_size > 0:
        _check_expert_ranks(cfg, p.data_parallel_shard_size)


def _check_expert_ranks(cfg: Config, dp_shard: int) -> None:
    p = cfg.parallel
    ep, cp = p.expert_model_parallel_size, p.context_parallel_size
    _require(
        dp_shard * cp % ep == 0,
        f"parallel.expert_model_parallel_size={ep} must divide data_parallel_shard_size={dp_shard} * "
        f"context_parallel_size={cp} = {dp_shard * cp} (expert ranks are folded out of them)",
    )


def check_expert_mesh(cfg: Config, dp_shard: int) -> None:
    """With the world size known: expert ranks fold out of the data-parallel shard x cp ranks."""
    if cfg.model.moe_enabled:
        _check_expert_ranks(cfg, dp_shard)


def check_group_routing(m) -> None:
    """Group-limited routing and the routed weights' scaling (Megatron ignores the group count
    without moe_router_group_topk, and so does dtgpt)."""
    factor = m.moe_router_topk_scaling_factor
    _require(factor is None or factor > 0, f"model.moe_router_topk_scaling_factor={factor} must be > 0 (or unset)")
    group_topk, groups, e, k = m.moe_router_group_topk, m.moe_router_num_groups, m.num_experts, m.moe_router_topk
    if not group_topk:
        return
    _require(groups is not None and groups >= 1, f"model.moe_router_group_topk={group_topk} needs model.moe_router_num_groups")
    _require(e % groups == 0, f"model.moe_router_num_groups={groups} must divide model.num_experts={e}")
    _require(
        1 <= group_topk <= groups,
        f"model.moe_router_group_topk={group_topk} must be in [1, model.moe_router_num_groups={groups}]",
    )
    _require(
        group_topk <= k <= group_topk * (e // groups),
        f"model.moe_router_topk={k} must be in [moe_router_group_topk={group_topk}, moe_router_group_topk * experts "
        f"per group = {group_topk * (e // groups)}] (each chosen group is scored by its top topk/group_topk experts)",
    )


def check_dispatcher(m) -> None:
    """Megatron's own rules on its token dispatchers, which choose only how tokens travel: refused
    where Megatron refuses, so a script dtgpt runs is one Megatron runs."""
    kind, backend = m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend
    _require(
        not m.moe_enable_deepep or kind == "flex",
        f"model.moe_enable_deepep=true needs model.moe_token_dispatcher_type='flex' (got {kind!r}), as in Megatron",
    )
    _require(
        not m.moe_enable_deepep or backend != "hybridep",
        "model.moe_enable_deepep=true names the DeepEP backend but model.moe_flex_dispatcher_backend='hybridep'; "
        "keep one, as Megatron",
    )
    deepep = kind == "flex" and (m.moe_enable_deepep or backend == "deepep")
    _require(
        not (deepep and m.moe_pad_expert_input_to_capacity),
        "model.moe_pad_expert_input_to_capacity=true is not taken with model.moe_token_dispatcher_type='flex' and the "
        "DeepEP backend: DeepEP sends only the kept (token, expert) pairs and cannot pad, and Megatron refuses it too",
    )
