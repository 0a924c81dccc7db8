"""Parallelise a GPT: the one place where TP, CP, dropout's RNG, recomputation, compile and FSDP meet.

`parallelize()` applies them to one model (or pipeline stage) in that visible order;
`build_model_parts()` cuts a GPT built on meta into this rank's pipeline stages and parallelises
each (`build_meta_parts()`, all that the planner needs), then materialises and initialises the
weights (`materialize()`) so that every layout starts from bitwise-identical full weights.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import FSDPModule

from dtgpt.config import (
    Config, fsdp_reshards_after_forward, grads_reduced_in_fp32, keys_on_token_index, layout_invariant_dropout, num_pipeline_stages,
)
from dtgpt.config.recompute_rules import selective_modules
from dtgpt.model import GPT
from dtgpt.moe.forced_balance import apply_forced_balance
from dtgpt.moe.stats import RoutingStats, moe_layers
from dtgpt.mtp import MTPLoss
from dtgpt.parallel.compile import apply_compile
from dtgpt.parallel.compute_copy import ComputeCopy
from dtgpt.parallel.context import apply_cp
from dtgpt.parallel.context_shift import ContextParallelShift
from dtgpt.parallel.dims import ParallelDims
from dtgpt.parallel.expert import apply_ep, apply_moe_sequence_ranks
from dtgpt.parallel.fsdp import apply_fsdp, mixed_precision_policy
from dtgpt.parallel.invariant_dropout import apply_invariant_dropout
from dtgpt.parallel.model_parts import ModelParts, build_cross_entropy
from dtgpt.parallel.pipeline import (
    ScheduleCache,
    build_pipeline_stages,
    build_stage_model,
    stage_ids_on_rank,
    stage_layer_counts,
)
from dtgpt.parallel.recompute import apply_recompute
from dtgpt.parallel.regions import local_part
from dtgpt.parallel.rng import ModelParallelRNG, apply_rng_streams, model_parallel_seed
from dtgpt.parallel.tensor import apply_tp
from dtgpt.parallel.tied import build_tied_group

__all__ = [
    "ParallelDims", "ModelParts", "build_model_parts", "build_meta_parts", "materialize", "parallelize",
    "compute_dtype",
]  # fmt: skip


def compute_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype the model computes in under fp16/bf16 (parallel/fsdp.py), or None for fp32."""
    if cfg.training.bf16:
        return torch.bfloat16
    if cfg.training.fp16:
        return torch.float16
    return None


def grad_reduce_dtype(cfg: Config) -> torch.dtype:
    """The dtype gradients are accumulated and reduced in: fp32, or the compute dtype for fp16
    without accumulate_allreduce_grads_in_fp32 (config.grads_reduced_in_fp32)."""
    return torch.float32 if grads_reduced_in_fp32(cfg) else compute_dtype(cfg)


def uses_compute_copy(cfg: Config, dims: ParallelDims) -> bool:
    """fp16/bf16 where no rank shares a weight (dp x cp = 1: one process, tp, pp): the regime is
    a compute-dtype copy of the fp32 masters (parallel/compute_copy.py), not FSDP's cast, whose
    hooks would cost host time for nothing. An MoE model keeps FSDP's (its routing statistics
    live on the modules the trainer holds). A compiled run under tp runs the copy too: its loss
    is dtgpt's vocabulary-parallel one on local tensors (parallel/vocab_parallel_loss.py), which
    inductor compiles where it failed on torch's loss_parallel() of the copy's logits."""
    return dims.low_precision and dims.dp * dims.cp == 1 and not cfg.model.moe_enabled


def parallelize(
    model: GPT, dims: ParallelDims, cfg: Config, rng: ModelParallelRNG | None = None, *, compute_twin: bool = False
) -> None:
    """TP -> CP -> EP -> layout-invariant dropout -> recomputation -> compile -> FSDP, in place, on one model/stage.

    `rng` (under tp, with Megatron's RNG) is the model-parallel stream that tensor-parallel
    dropout draws from; with model.dropout_rng='layout_invariant' there is none.
    `compute_twin`: the model is a compute copy's twin (parallel/compute_copy.py): its
    replicated modules stay plain (apply_tp's local_replicas).
    """
    if dims.tp_enabled:
        apply_tp(
            model,
            dims.sub("tp"),
            sequence_parallel=cfg.parallel.sequence_parallel,
            loss_parallel=cfg.parallel.loss_parallel,
            moe_folded=dims.tp_folds_into_moe,
            local_replicas=compute_twin,
        )
        if rng is not None:
            apply_rng_streams(model, rng, sequence_parallel=cfg.parallel.sequence_parallel)
    if dims.cp_enabled:  # before recomputation, which may wrap the attention core it replaces
        apply_cp(model, dims.sub("cp"))
    if (dims.tp_enabled or dims.cp_enabled) and moe_layers([model]):
        apply_moe_sequence_ranks(model, dims.sequence_mesh())
    if dims.ep_enabled:
        apply_ep(model, dims.sub("ep"), dims.expert_mesh())
    if layout_invariant_dropout(cfg):  # after CP (its core wraps cp's), before recomputation
        apply_invariant_dropout(model, cfg.training.seed, dims.tp_rank, dims.tp, cfg.parallel.sequence_parallel)
    if cfg.model.moe_enabled and cfg.model.moe_router_force_load_balancing:  # before recomputation wraps the blocks
        apply_forced_balance(model, cfg.training.seed, dims.tp_rank, dims.tp, cfg.parallel.sequence_parallel)
    t = cfg.training
    apply_recompute(model, t.recompute_granularity, t.recompute_method, t.recompute_num_layers, rng, selective_modules(t))
    if cfg.training.compile and not uses_compute_copy(cfg, dims):  # where a parity test covers it (config validation)
        apply_compile(model, dims)  # (a compute copy compiles the copy, in build_model_parts)
    if cfg.training.fp32_residual_connection and model.embedding is not None:
        model.embedding.fp32_residual = True  # the stream is fp32 from the embedding on
    if dims.fsdp_enabled and not uses_compute_copy(cfg, dims):
        apply_fsdp(
            model,
            dims.fsdp_mesh(),
            mixed_precision_policy(compute_dtype(cfg), grad_reduce_dtype(cfg)),
            reshard_after_forward=fsdp_reshards_after_forward(cfg),
            expert_mesh=dims.expert_fsdp_mesh() if dims.ep_enabled else None,
            moe_mesh=dims.moe_fsdp_mesh(),
        )
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # The loss is already divided by the global token count: sum gradients, never average.
                module.set_gradient_divide_factor(1.0)
                # Plain SUM collectives (gloo has no pre-multiplied sum; with factor 1 it is the same).
                module.set_force_sum_reduction_for_comms(True)


def build_model_parallel_rng(cfg: Config, dims: ParallelDims, device: torch.device) -> ModelParallelRNG | None:
    """This rank's model-parallel generator (dtgpt.parallel.rng), or None without tp or with
    layout-invariant dropout (which draws from no generator)."""
    if not dims.tp_enabled or layout_invariant_dropout(cfg):
        return None
    return ModelParallelRNG(device, model_parallel_seed(cfg.training.seed, dims.pp_rank, dims.tp_rank))


def build_meta_parts(
    cfg: Config, dims: ParallelDims, model: GPT, rng: ModelParallelRNG | None = None, *, compute_twin: bool = False
) -> tuple[list[GPT], list[int], int]:
    """Cut `model` (on meta) into this rank's stages and parallelise each; nothing is allocated.

    Returns (parts, stage_ids, num_stages). The planner (dtgpt.plan) calls this alone, on the
    meta device under a fake process group, so it counts exactly what training will hold.
    """
    if dims.pp_enabled:
        counts = stage_layer_counts(cfg)
        stage_ids = stage_ids_on_rank(
            dims.pp_rank, dims.pp, cfg.parallel.virtual_pipeline_stages_per_rank, cfg.parallel.pipeline_schedule
        )
        parts = [build_stage_model(model, sid, counts) for sid in stage_ids]
        num_stages = len(counts)
    else:
        parts, stage_ids, num_stages = [model], [0], 1
    for part in parts:
        parallelize(part, dims, cfg, rng, compute_twin=compute_twin)
    return parts, stage_ids, num_stages


def materialize(part: GPT, cfg: Config, device: torch.device) -> None:
    """Allocate a parallelised meta part on `device` and give it its seeded initial weights."""
    part.to_empty(device=device)
    if part.tied and part.embedding is not None and part.output is not None:
        part.output.weight = part.embedding.word.weight  # to_empty may give each user a copy
    part.init_weights(cfg.training.seed, local=local_part)


def first_rank_stages(cfg: Config) -> list[int]:
    """The pipeline stages pp rank 0 holds (V-shaped schedules give it the last one too)."""
    p = cfg.parallel
    return stage_ids_on_rank(0, p.pipeline_model_parallel_size, p.virtual_pipeline_stages_per_rank, p.pipeline_schedule)


def last_stage_rank(cfg: Config, world_size: int) -> int:
    """The highest global rank holding the last pipeline stage: Megatron logs from there (its
    last rank). pp is the outermost mesh dimension, so pp rank r is the r-th block of
    world_size / pp ranks; the last stage is on pp rank pp - 1, or 0 under a V-shaped schedule."""
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    last = num_pipeline_stages(cfg) - 1
    holder = next(r for r in range(pp) if last in stage_ids_on_rank(r, pp, p.virtual_pipeline_stages_per_rank, p.pipeline_schedule))
    return (holder + 1) * (world_size // pp) - 1


def build_model_parts(cfg: Config, dims: ParallelDims, model: GPT, device: torch.device) -> ModelParts:
    """Cut `model` (built on meta) into this rank's stages, parallelise, materialise, init."""
    rng = build_model_parallel_rng(cfg, dims, device)
    # A compute copy's twins are the same parts built again (on meta: their weights will be views
    # of the copy's buffer), so they carry the same plan, hooks and dropout streams.
    twin_model = copy.deepcopy(model) if uses_compute_copy(cfg, dims) else None
    parts, stage_ids, num_stages = build_meta_parts(cfg, dims, model, rng)
    for part in parts:
        materialize(part, cfg, device)
    compute_copies = ()
    if twin_model is not None:
        twins, _, _ = build_meta_parts(cfg, dims, twin_model, rng, compute_twin=True)
        compute_copies = tuple(ComputeCopy(p, t, compute_dtype(cfg), grad_reduce_dtype(cfg)) for p, t in zip(parts, twins))
        if cfg.training.compile:
            for c in compute_copies:
                apply_compile(c.module, dims, whole=dims.world_size == 1)
    schedules = None
    if dims.pp_enabled:
        run = [c.module for c in compute_copies] or parts
        stages = build_pipeline_stages(run, stage_ids, num_stages, device, dims.sub("pp"),
                                       after_backward=[c.after_stage_backward for c in compute_copies] or None)  # fmt: skip
        schedules = ScheduleCache(stages, cfg.parallel.pipeline_schedule)
    return ModelParts(
        parts=parts,
        stage_ids=stage_ids,
        num_stages=num_stages,
        dims=dims,
        device=device,
        schedules=schedules,
        grad_reduce_dtype=grad_reduce_dtype(cfg),
        fsdp_reshard_every_micro_batch=fsdp_reshards_after_forward(cfg),
        tied_group=build_tied_group(dims, parts, ends_on_one_rank=num_stages - 1 in first_rank_stages(cfg)),
        cross_entropy=build_cross_entropy(cfg.training.compile, in_fp32=not cfg.training.fp16_lm_cross_entropy,
                                          vocab_parallel=dims.tp_enabled and cfg.parallel.loss_parallel),
        rng=rng,
        compute_copies=compute_copies,
        routing_stats=RoutingStats(cfg.model) if cfg.model.moe_enabled else None,
        mtp_loss=MTPLoss(cfg.model, ContextParallelShift(dims.sub("cp")) if dims.cp_enabled else None) if cfg.model.mtp_depth else None,
        token_index=keys_on_token_index(cfg),
        # Per-token inputs every stage needs: its chunks' positions under cp, Megatron's reset
        # options, the token indices that layout-invariant dropout and forced balance key on.
        every_stage_reads_batches=(
            dims.cp_enabled or cfg.data.reset_position_ids or cfg.data.reset_attention_mask or keys_on_token_index(cfg)
        ),
    )
