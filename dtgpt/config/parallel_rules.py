"""The rules of the parallel layout: tensor, context and pipeline parallelism, compile and
recomputation (check_parallelism needs no world size; validation.py holds the mesh product and
calls check_pipeline_microbatches once it knows the data-parallel size)."""

from __future__ import annotations

from dtgpt.config.batch_schedule import smallest_batch_size
from dtgpt.config.derived import layout_invariant_dropout, num_microbatches, num_pipeline_stages
from dtgpt.config.pipeline_split import check_pipeline_split, megatron_stage_layers
from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require

PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
# Schedules that place two or more stages on every rank.
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that run each stage of a rank over a round of micro-batches in turn (interleaved_round_size).
INTERLEAVED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")

def _check_tensor_parallel(cfg: Config) -> None:
    """Rules of tensor parallel."""
    m = cfg.model
    p = cfg.parallel
    tp = cfg.parallel.tensor_model_parallel_size
    _require(
        m.num_attention_heads % tp == 0,
        f"parallel.tensor_model_parallel_size={tp} must divide model.num_attention_heads={m.num_attention_heads}",
    )
    _require(
        m.query_groups % tp == 0 or tp % m.query_groups == 0,
        f"parallel.tensor_model_parallel_size={tp} and model.num_query_groups={m.query_groups} must divide one "
        "another (each rank holds whole key/value groups, or a share of one group's query heads)",
    )
    _require(
        m.query_groups >= tp or not m.qk_layernorm,
        f"model.qk_layernorm=true needs model.num_query_groups={m.query_groups} >= "
        f"parallel.tensor_model_parallel_size={tp}: with ranks sharing a group, each would normalise "
        "the same keys, and their weight gradients would be summed as if they were others",
    )
    _require(
        m.ffn_size % tp == 0,
        f"parallel.tensor_model_parallel_size={tp} must divide the MLP width model.ffn_hidden_size={m.ffn_size}",
    )
    _require(
        not (p.sequence_parallel and tp > 1) or m.seq_length % tp == 0,
        f"parallel.tensor_model_parallel_size={tp} must divide model.seq_length={m.seq_length} "
        "under parallel.sequence_parallel=true",
    )


def _check_context_parallel(cfg: Config) -> None:
    """Rules of context parallel: whole chunk pairs per rank (and per tp rank under SP)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if cp == 1:
        return
    chunks = 2 * cp * (tp if p.sequence_parallel else 1)
    _require(
        m.seq_length % chunks == 0,
        f"model.seq_length={m.seq_length} must be divisible by 2 * parallel.context_parallel_size={cp}"
        + (f" * tensor_model_parallel_size={tp} (sequence parallel)" if chunks != 2 * cp else "") + f" = {chunks}",
    )
    # Under Megatron's RNG a dropout mask is drawn per rank from streams with no cp term (as in
    # Megatron): cp peers would drop the same pattern in different chunks of one sequence, and
    # SDPA's attention mask would depend on how the sequence is split. The layout-invariant RNG
    # keys every element on its global token instead (dtgpt/parallel/invariant_dropout.py).
    if m.dropout_rng == "megatron":
        for key, why in (
            ("hidden_dropout", "cp ranks would draw the same mask for different chunks of a sequence"),
            ("attention_dropout", "the attention dropout mask would depend on how the sequence is split"),
        ):
            value = getattr(m, key)
            _require(
                value == 0.0,
                f"model.{key}={value} must be 0 with parallel.context_parallel_size={cp} under "
                f"model.dropout_rng='megatron' ({why}); set it to 0 or model.dropout_rng='layout_invariant'",
            )
    _require(
        not t.compile,
        f"training.compile=true is not supported with parallel.context_parallel_size={cp} (> 1): "
        "no parity test covers it yet; set training.compile=false",
    )


def _check_pipeline(cfg: Config) -> None:
    """Rules of pipeline parallel."""
    m = cfg.model
    p = cfg.parallel
    pp = cfg.parallel.pipeline_model_parallel_size
    vpp = cfg.parallel.virtual_pipeline_stages_per_rank
    stages = pp * vpp
    check_pipeline_split(cfg, V_SHAPED_SCHEDULES)
    if p.pipeline_layers_per_stage:
        counts = p.pipeline_layers_per_stage
        _require(
            len(counts) == stages,
            f"parallel.pipeline_layers_per_stage has {len(counts)} entries; it needs one per stage "
            f"(pipeline_model_parallel_size * virtual_pipeline_stages_per_rank = {stages})",
        )
        _require(
            sum(counts) == m.num_layers and min(counts) >= 0,
            f"parallel.pipeline_layers_per_stage={counts} must be >= 0 and sum to model.num_layers={m.num_layers}",
        )
        empty = [i for i, c in enumerate(counts[1:-1], start=1) if c == 0]
        _require(
            not empty,
            f"parallel.pipeline_layers_per_stage={counts}: middle stage {empty[0] if empty else ''} would hold "
            "nothing (only the first stage may be just the embedding, the last just the head)",
        )
    elif megatron_stage_layers(cfg) is None:
        _require(
            m.num_layers % stages == 0,
            f"model.num_layers={m.num_layers} must be divisible by the number of pipeline stages "
            f"(pipeline_model_parallel_size={pp} * virtual_pipeline_stages_per_rank={vpp} = {stages}); "
            "or give parallel.pipeline_layers_per_stage",
        )
    if pp > 1 or vpp > 1:
        multi = p.pipeline_schedule in MULTI_STAGE_SCHEDULES
        if multi:
            _require(
                vpp >= 2,
                f"parallel.pipeline_schedule={p.pipeline_schedule!r} places several stages per rank: "
                f"set parallel.virtual_pipeline_stages_per_rank >= 2 (got {vpp})",
            )
        else:
            _require(
                vpp == 1,
                f"parallel.virtual_pipeline_stages_per_rank={vpp} needs a multi-stage schedule "
                f"({', '.join(MULTI_STAGE_SCHEDULES)}), not parallel.pipeline_schedule={p.pipeline_schedule!r}",
            )
        if p.pipeline_schedule in V_SHAPED_SCHEDULES:
            _require(
                vpp == 2,
                f"parallel.pipeline_schedule={p.pipeline_schedule!r} is V-shaped and needs "
                f"parallel.virtual_pipeline_stages_per_rank=2 (got {vpp})",
            )


def check_pipeline_microbatches(cfg: Config, dp: int) -> None:
    """The micro-batch counts of the run against the pipeline schedule, before any process group.

    Every schedule runs every count (dtgpt/parallel/schedules.py: 1F1B with fewer micro-batches
    than stages as Megatron does, the interleaved ones in rounds that divide the count) except
    DualPipeV, which needs one micro-batch per stage. The count grows with the batch, so of
    every batch size the ramp-up reaches the first (smallest) is the one to check.
    """
    p, t = cfg.parallel, cfg.training
    if p.pipeline_model_parallel_size == 1 or p.pipeline_schedule != "DualPipeV":
        return
    stages = num_pipeline_stages(cfg)
    batch, key = smallest_batch_size(t, cfg.model.seq_length)
    micro = num_microbatches(cfg, dp, batch, key)
    _require(
        micro >= stages,
        f"parallel.pipeline_schedule='DualPipeV' needs at least as many micro-batches per iteration as pipeline "
        f"stages (pipeline_model_parallel_size={p.pipeline_model_parallel_size} * virtual_pipeline_stages_per_rank="
        f"{p.virtual_pipeline_stages_per_rank} = {stages}), but {key}={batch} gives {micro} micro-batches "
        f"({batch} / (micro_batch_size={t.micro_batch_size} * data-parallel size {dp})); "
        f"use a first batch of >= {stages * t.micro_batch_size * dp} or a schedule that runs any count (ZBVZeroBubble)",
    )


def _check_compile(cfg: Config) -> None:
    """Rules of compile: allowed where a parity test covers it (tests/test_compile.py, test_parity.py).

    On one rank, under FSDP, tp (with or without SP), 1F1B pipelines and each pair of these,
    compiled blocks are checked against one eager process (pp x dp x tp is allowed from its
    pairs), without recomputation; dropout under tp (with and without SP) draws eager's masks from
    Megatron's streams (dtgpt/parallel/compile.py), checked against eager tp2. Refused: other
    schedules (they split or reorder the backward of each stage); recomputation, which re-enters
    compiled blocks; layout-invariant dropout under tp (no test compiles it); and RoPE under tp, whose compiled backward torch 2.13 gets wrong (an AttributeError in DTensor's
    redistribute backward; with qk_layernorm no error, and gradient norms 25% off).
    """
    t, p, m = cfg.training, cfg.parallel, cfg.model
    if not t.compile:
        return
    _require(
        t.recompute_granularity is None,
        f"training.compile=true is not supported with training.recompute_granularity={t.recompute_granularity!r}: "
        "no parity test covers compiled recomputation; set training.compile=false or unset training.recompute_granularity",
    )
    tp = p.tensor_model_parallel_size
    _require(
        tp == 1 or not layout_invariant_dropout(cfg),
        f"training.compile=true is not supported with model.dropout_rng='layout_invariant' under "
        f"parallel.tensor_model_parallel_size={tp}: no parity test covers compiled layout-invariant dropout under tp; "
        "set training.compile=false or model.dropout_rng='megatron'",
    )
    _require(
        p.pipeline_model_parallel_size == 1 or p.pipeline_schedule == "1F1B",
        f"training.compile=true is not supported with parallel.pipeline_schedule={p.pipeline_schedule!r}: "
        "compiled pipelines are parity-tested with '1F1B' only; set training.compile=false",
    )
    _require(
        tp == 1 or m.position_embedding_type != "rope",
        f"training.compile=true is not supported with model.position_embedding_type='rope' under "
        f"parallel.tensor_model_parallel_size={tp}: torch 2.13's compiled backward of RoPE blocks under tp fails "
        "(or, with qk_layernorm, gives wrong gradients); set training.compile=false",
    )


def _check_recompute(cfg: Config) -> None:
    """Rules of recomputation: which of Megatron's three flags go together."""
    t = cfg.training
    granularity, method, n = t.recompute_granularity, t.recompute_method, t.recompute_num_layers
    _require(n is None or n >= 1, f"training.recompute_num_layers={n} must be >= 1")
    if granularity == "full":
        _require(
            method is not None and n is not None,
            "training.recompute_granularity='full' needs training.recompute_method ('uniform' or 'block') "
            f"and training.recompute_num_layers >= 1 (got method={method!r}, num_layers={n})",
        )
    else:
        for key, value in (("recompute_method", method), ("recompute_num_layers", n)):
            why = "'selective' recomputes training.recompute_modules of every block" if granularity else "it is unset"
            _require(
                value is None,
                f"training.{key}={value!r} applies only to training.recompute_granularity='full' ({why}); "
                f"leave {key} unset",
            )


def check_parallelism(cfg: Config) -> None:
    _check_tensor_parallel(cfg)
    _check_context_parallel(cfg)
    _check_pipeline(cfg)
    _check_compile(cfg)
    _check_recompute(cfg)
