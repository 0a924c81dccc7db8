"""What the planner tells a person: warnings that matter and the per-rank table.

Pure functions of a finished plan (dtgpt.plan.results.Plan); nothing here builds a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtgpt.config import (
    INTERLEAVED_SCHEDULES,
    MULTI_STAGE_SCHEDULES,
    Config,
    TrainingConfig,
    fsdp_reshards_after_forward,
    interleaved_round_size,
)
from dtgpt.model_size import num_moe_layers
from dtgpt.parallel import uses_compute_copy
from dtgpt.plan.links import GPUS_PER_NODE
from dtgpt.plan.results import Plan, RankPlan

if TYPE_CHECKING:  # pragma: no cover
    from dtgpt.config.batch_schedule import BatchSizeSchedule
    from dtgpt.parallel import ParallelDims

RAMPUP_BUBBLE_WARNING = 0.2
"""Warn when the first ramp-up iterations idle more than this fraction of the time."""

MEMORY_TERMS = ("params", "copies", "grads", "adam", "activations", "muon_step")


def _knobs(cfg: Config, dims: "ParallelDims", term: str) -> list[str]:
    """The settings that shrink `term` on the fullest rank, most effective first."""
    t, p = cfg.training, cfg.parallel
    if term == "activations":
        knobs = []
        if t.recompute_granularity is None:
            knobs.append("training.recompute_granularity='selective' (drops each layer's attention scores)")
        if t.recompute_granularity != "full":
            knobs.append("training.recompute_granularity='full' with recompute_method='uniform' and "
                         "recompute_num_layers=1 (keeps only each layer's input)")  # fmt: skip
        if dims.tp > 1 and not p.sequence_parallel:
            knobs.append("parallel.sequence_parallel=true (divides the norm/dropout activations by tp)")
        if t.micro_batch_size > 1:
            knobs.append(f"a smaller training.micro_batch_size (now {t.micro_batch_size})")
        knobs.append("more parallel.tensor_model_parallel_size (1F1B's first stage keeps pp micro-batches of "
                     "L/pp layers, so more pp alone does not help it)")  # fmt: skip
        return knobs
    if term == "copies" and dims.fsdp_enabled and not uses_compute_copy(cfg, dims) and not fsdp_reshards_after_forward(cfg):
        return ["parallel.fsdp_reshard_after_forward='always' (ZeRO-3: parameters re-gathered in every "
                "micro-batch instead of kept gathered through the iteration)"]  # fmt: skip
    return [
        "more parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size (fewer parameters per GPU)",
        "parallel.data_parallel_shard_size > 1 (FSDP shards parameters, gradients and Adam state over dp)",
    ]


def layout_warnings(cfg: Config, plan: Plan, batches: "BatchSizeSchedule", dims: "ParallelDims") -> list[str]:
    warnings = []
    over = [r for r in plan.ranks if r.memory_gib > plan.gpu_memory_gib]
    if over:
        worst = max(over, key=lambda r: r.memory_gib)
        term = max(MEMORY_TERMS, key=lambda k: worst.memory[k])
        share = worst.memory[term] / worst.memory_gib
        warnings.append(
            f"{len(over)} of {len(plan.ranks)} planned ranks exceed {plan.gpu_memory_gib:g} GiB; the fullest "
            f"(pp {worst.pp_rank}, tp {worst.tp_rank}) needs {worst.memory_gib:.3g} GiB, {share:.0%} of it "
            f"{term} ({worst.memory[term]:.3g} GiB). Try: " + "; ".join(_knobs(cfg, dims, term))
        )
    pp, stages = dims.pp, dims.pp * cfg.parallel.virtual_pipeline_stages_per_rank
    if dims.pp_enabled and plan.microbatches < stages:
        warnings.append(
            f"{plan.microbatches} micro-batches per iteration at the final batch size on {stages} pipeline stages: "
            f"they run ({_fewer_than_stages(cfg, plan.microbatches)}), but {plan.bubble_fraction:.0%} of each "
            "iteration idles; raise the batch size or lower pp"
        )
    if batches.enabled and plan.bubble_fraction_initial > RAMPUP_BUBBLE_WARNING:
        seq = cfg.model.seq_length
        ramp_tokens = batches.ramp_samples * seq
        fewer = f", {_fewer_than_stages(cfg, plan.microbatches_initial)}" if plan.microbatches_initial < stages else ""
        warnings.append(
            f"large pipeline bubble during ramp-up: at global batch {batches.start} ({plan.microbatches_initial} "
            f"micro-batches on {stages} stages{fewer}) {plan.bubble_fraction_initial:.0%} of each iteration idles, "
            f"against {plan.bubble_fraction:.1%} at {batches.final}; the ramp lasts {batches.ramp_samples:,} samples "
            f"({ramp_tokens / 1e9:.1f}B tokens, {ramp_tokens / plan.tokens:.1%} of {plan.tokens / 1e9:g}B)"
        )
    longer = _longer_rounds(cfg, plan.microbatch_counts, pp)
    if longer:
        plan.notes.append(
            f"{cfg.parallel.pipeline_schedule} runs a count that pp={pp} does not divide in longer rounds "
            f"({longer}): more chunks in flight; the xN column is the peak over every batch size of the run"
        )
    if cfg.parallel.pipeline_schedule in MULTI_STAGE_SCHEDULES and cfg.parallel.pipeline_schedule != "Interleaved1F1B":
        plan.notes.append(
            f"{cfg.parallel.pipeline_schedule}: activations in flight assumed as for Interleaved1F1B and the bubble "
            "given is the interleaved one (an upper bound for zero-bubble schedules)"
        )
    return warnings


def _fewer_than_stages(cfg: Config, microbatches: int) -> str:
    """How the schedule runs fewer micro-batches than stages (dtgpt/parallel/schedules.py)."""
    schedule = cfg.parallel.pipeline_schedule
    if schedule == "1F1B":
        return f"1F1B's warm-up capped at {microbatches}, as in Megatron: no steady 1F1B phase on the first stages"
    if schedule in INTERLEAVED_SCHEDULES:
        return f"{schedule} in one round of {microbatches}"
    return f"{schedule} runs any count"


def _longer_rounds(cfg: Config, counts: list[int], pp: int) -> str:
    """The interleaved counts of the run whose rounds are longer than pp, as 'm in rounds of g'."""
    if cfg.parallel.pipeline_schedule not in INTERLEAVED_SCHEDULES or pp == 1:
        return ""
    longer = [(m, interleaved_round_size(m, pp)) for m in counts if m > pp and m % pp]
    return ", ".join(f"{m} micro-batches in rounds of {g}" for m, g in longer)


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _layers(ids: list[int]) -> str:
    if not ids:
        return "-"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return _span(ids)
    return ",".join(map(str, ids))


def _merged(ranks: list[RankPlan]) -> list[tuple[list[RankPlan], RankPlan]]:
    """Rows that differ only in tp rank are shown once ("tp 0-7")."""
    rows: list[tuple[list, RankPlan]] = []
    for r in ranks:
        if rows:
            group, first = rows[-1]
            key = lambda x: (x.pp_rank, x.dp_rank, x.local_params, x.memory)  # noqa: E731
            same = key(first) == key(r)
            if same and r.tp_rank == group[-1].tp_rank + 1:
                group.append(r)
                continue
        rows.append(([r], r))
    return rows


def _recompute_text(t: TrainingConfig) -> str:
    if t.recompute_granularity == "full":
        return f"full ({t.recompute_method}, {t.recompute_num_layers} layers)"
    return t.recompute_granularity or "none"


def _comm_lines(plan: Plan) -> list[str]:
    """Bytes each rank sends (and receives) per iteration, per pp rank when they differ."""
    iterations = plan.est_days * 86400 / plan.est_iteration_s if plan.est_iteration_s else 0
    with_comm = (plan.est_iteration_s + plan.est_comm_s) * iterations / 86400
    lines = []
    mesh = plan.mesh
    in_node = "tp/cp" if mesh["cp"] > 1 and mesh["cp"] * mesh["tp"] <= GPUS_PER_NODE else "tp"
    if mesh["ep"] > 1 and mesh["ep"] * mesh["tp"] <= GPUS_PER_NODE:  # dtgpt.plan.links
        in_node += "/ep"
    across = "pp/dp" if in_node == "tp/cp" or mesh["cp"] == 1 else "pp/dp/cp"
    for t in plan.comm:
        lines.append(
            f"comm       pp rank {t.pp_rank}: sends and receives {t.sent_bytes / 1e9:.3g} GB per iteration "
            f"({t.nvlink_bytes / 1e9:.3g} GB {in_node} over NVLink, {(t.sent_bytes - t.nvlink_bytes) / 1e9:.3g} GB "
            f"{across} over InfiniBand): {t.seconds:.2f} s"
        )
    if len(lines) > 4:  # the 175B layout has 16 pp ranks: first, a middle one, last
        lines = [lines[0], lines[len(lines) // 2], lines[-1]]
    if any(plan.all_to_all_bytes):
        per_rank = ", ".join(f"{b / 1e9:.3g}" for b in plan.all_to_all_bytes)
        lines.append(
            f"all-to-all each rank sends {per_rank} GB of routed tokens per iteration (pp rank 0 to {len(plan.all_to_all_bytes) - 1}; "
            f"dispatch and combine, forward and backward, over ep {mesh['ep']})"
        )
    if lines:
        lines.append(
            f"comm       not overlapped with compute: {plan.est_iteration_s + plan.est_comm_s:.2f} s per iteration, "
            f"{with_comm:.1f} days (the bound; overlapped fully: the compute time above)"
        )
    return lines


def _moe_line(cfg: Config, plan: Plan) -> str:
    m = cfg.model
    ffn = m.expert_ffn_size
    shared = f" + a shared expert of {m.moe_shared_expert_intermediate_size}" if m.moe_shared_expert_intermediate_size else ""
    return (
        f"experts    {m.num_experts} of width {ffn}{shared} in {num_moe_layers(m)} of {m.num_layers} blocks, top-{m.moe_router_topk}; "
        f"ep {plan.mesh['ep']} (each rank holds {m.num_experts // plan.mesh['ep']} per layer), experts FSDP-sharded "
        f"over the {plan.mesh['efsdp']} data-parallel ranks that remain"
    )


def format_plan(cfg: Config, plan: Plan) -> str:
    m, t, p = cfg.model, cfg.training, cfg.parallel
    mesh = plan.mesh
    precision = "fp16" if t.fp16 else "bf16" if t.bf16 else "fp32"
    muon = cfg.optimizer.uses_muon
    lines = [
        f"model      {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, "
        f"vocab {plan.vocab_size} -> {plan.padded_vocab_size} padded: {plan.total_params:,} parameters"
        + (f" ({plan.active_params:,} active per token)" if m.moe_enabled else "")
        + (f", and {plan.mtp_params:,} of multi-token prediction apart" if plan.mtp_params else ""),
        *([_moe_line(cfg, plan)] if m.moe_enabled else []),
        f"layout     {plan.world_size} GPUs = pp {mesh['pp']} x dp_replicate {mesh['dp_replicate']} x dp_shard "
        f"{mesh['dp_shard']} x cp {mesh['cp']} x tp {mesh['tp']}"
        + (f", {mesh['vpp']} virtual stages per rank" if mesh["vpp"] > 1 else "")
        + f"; sequence_parallel={str(p.sequence_parallel).lower()}, {precision}, "
        f"recompute={_recompute_text(t)}",
        f"schedule   {p.pipeline_schedule}: {plan.microbatches} micro-batches per iteration (initial ramp-up: "
        f"{plan.microbatches_initial}); bubble {plan.bubble_fraction:.1%} (initial {plan.bubble_fraction_initial:.1%})",
        f"compute    {plan.flops_per_token / 1e9:.4g} GFLOP per token ({plan.hardware_flops_per_token / 1e9:.4g} with "
        f"recomputation), {plan.flops_per_iteration:.3e} FLOP per iteration of {plan.tokens_per_iteration:,} tokens",
        f"time       at {plan.tflops:g} TFLOP/s per GPU: {plan.est_iteration_s:.2f} s per iteration, "
        f"{plan.est_days:.1f} days for {plan.tokens / 1e9:g}B tokens",
        *_comm_lines(plan),
        "",
        f"memory per GPU in GiB (limit {plan.gpu_memory_gib:g}); 'acts': activations of N micro-batches in flight; "
        "'pipe': the pipeline's receive buffers" + ("; 'muon': Muon's step beyond the activations" if muon else ""),
        f"{'pp':>3} {'dp':>3} {'tp':>5} {'stage':>6} {'layers':>7} {'local params':>15} {'params':>7} {'copies':>7} "
        f"{'grads':>7} {'adam':>7} {'acts':>7} {'(xN)':>5} {'pipe':>6} " + (f"{'muon':>6} " if muon else "") + f"{'total':>7}",
    ]
    for group, r in _merged(plan.ranks):
        mem = r.memory
        flag = "  OVER" if r.memory_gib > plan.gpu_memory_gib else ""
        lines.append(
            f"{r.pp_rank:>3} {r.dp_rank:>3} {_span([g.tp_rank for g in group]):>5} "
            f"{','.join(map(str, r.stage_ids)):>6} "
            f"{_layers(r.layer_ids):>7} {r.local_params:>15,} {mem['params']:>7.2f} {mem['copies']:>7.2f} "
            f"{mem['grads']:>7.2f} {mem['adam']:>7.2f} {mem['activations']:>7.2f} {'x' + str(r.in_flight):>5} {mem.get('pipeline', 0.0):>6.2f} "
            + (f"{mem['muon_step']:>6.2f} " if muon else "") + f"{r.memory_gib:>7.2f}{flag}"
        )
    lines.append(f"({plan.builds} distinct ranks built on the fake process group; rows equal but for tp are merged)")
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines)
