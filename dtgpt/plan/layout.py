"""Plan a layout: build each distinct rank on the fake process group, then apply the formulas.

Every distinct (pp rank, tp rank) of the job is built on the meta device under PyTorch's "fake"
process group at the job's full world size, through the same `build_meta_parts()` -> `parallelize()`
code path that training runs (dtgpt.plan.ranks), so the parameter counts are those of the real
sharded DTensors. Nothing is allocated. Memory, bubble and time come from the formulas in
dtgpt.plan.activations and dtgpt.plan.memory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict

from dtgpt.config import (
    Config,
    ModelConfig,
    ConfigError,
    fsdp_reshards_after_forward,
    grads_reduced_in_fp32,
    low_precision,
    num_microbatches,
    num_pipeline_stages,
    padded_vocabulary,
    validate,
)
from dtgpt.config.derived import null_tokenizer_ids
from dtgpt.config.tokenizer_rules import SENTENCEPIECE_TYPES, TIKTOKEN_DEFAULT_VOCAB
from dtgpt.data.tokenizer import build_tokenizer
from dtgpt.model_size import flops_per_token, mtp_flops_per_token, mtp_parameters, num_parameters, router_flops_per_token
from dtgpt.config.batch_schedule import BatchSizeSchedule
from dtgpt.parallel import ParallelDims, uses_compute_copy
from dtgpt.plan import comm, comm_muon, links
from dtgpt.plan import memory as pm
from dtgpt.plan.activations import (
    ActivationShape,
    embedding_activation_bytes,
    head_activation_bytes,
    layer_activation_bytes,
)
from dtgpt.plan.activations_mtp import mtp_activation_bytes
from dtgpt.plan.ranks import BuiltRank, build_ranks
from dtgpt.plan.report import layout_warnings
from dtgpt.plan.results import LayoutError, Plan, RankPlan

GPT2_VOCAB_SIZE = 50257


# -- inputs ------------------------------------------------------------------------------------


def tokenizer_vocab_size(cfg: Config) -> tuple[int, str | None]:
    """The tokenizer's vocabulary as training will see it, without loading the tokenizer.

    Mirrors dtgpt.data.build_tokenizer; returns (size, a note when it had to assume).
    """
    d = cfg.data
    if (d.builtin_corpus and not d.mock_data) or d.tokenizer_type == "ByteTokenizer":
        return 257, None
    if d.tokenizer_type == "NullTokenizer":
        return null_tokenizer_ids(d) + 1, None  # the ids and the eod
    if d.tokenizer_type == "TikTokenizer":
        return d.vocab_size or TIKTOKEN_DEFAULT_VOCAB, None  # the whole vocabulary, whatever the file holds
    if d.tokenizer_type == "HuggingFaceTokenizer" or d.tokenizer_type in SENTENCEPIECE_TYPES:
        try:  # the count is in the model file (a Hugging Face one holds it in more than one place)
            return build_tokenizer(d).vocab_size, None
        except (ImportError, OSError, ValueError) as e:
            if d.vocab_size:
                return d.vocab_size, f"{e}: assuming data.vocab_size={d.vocab_size} tokens"
            return GPT2_VOCAB_SIZE, f"{e}: assuming GPT-2's {GPT2_VOCAB_SIZE} tokens"
    if d.mock_data and not d.vocab_file and not d.merge_file:
        return d.vocab_size or GPT2_VOCAB_SIZE, None
    if d.vocab_file and os.path.isfile(d.vocab_file):
        with open(d.vocab_file, encoding="utf-8") as f:
            return len(json.load(f)), None
    return GPT2_VOCAB_SIZE, f"data.vocab_file={d.vocab_file!r} not found: assuming GPT-2's {GPT2_VOCAB_SIZE} tokens"


def default_world_size(cfg: Config) -> int:
    """pp * dp_replicate * dp_shard * cp * tp, with dp_shard = -1 ("the rest") taken as 1, or
    under expert parallelism as the fewest ranks ep folds out of (dp_shard x cp a multiple of ep):
    Mixtral's pp 4 x ep 8 is 32 GPUs, as Megatron's script runs it on 4 nodes of 8."""
    p = cfg.parallel
    ep, cp = max(p.expert_model_parallel_size, 1), max(p.context_parallel_size, 1)
    dps = p.data_parallel_shard_size if p.data_parallel_shard_size > 0 else ep // math.gcd(ep, cp)
    model_parallel = p.pipeline_model_parallel_size * p.context_parallel_size * p.tensor_model_parallel_size
    return model_parallel * p.data_parallel_replicate_size * dps


def layout_errors(cfg: Config, world_size: int, vocab_size: int) -> list[str]:
    """Why this layout cannot run at all (empty when it can): the config and mesh rules, and the
    padded vocabulary split over tp (validation knows the vocabulary only for NullTokenizer)."""
    errors = []
    for check in (lambda: validate(cfg, world_size), lambda: padded_vocabulary(cfg, vocab_size)):
        try:
            check()
        except ConfigError as e:
            if str(e) not in errors:
                errors.append(str(e))
    return errors


# -- the plan ----------------------------------------------------------------------------------


def _activation_bytes(built: BuiltRank, shape: ActivationShape, model: ModelConfig) -> tuple[float, float]:
    """(bytes per chunk in flight averaged over the rank's stages, recompute working set)."""
    kinds = list(zip(built.layer_ids, built.recompute))
    total = sum(layer_activation_bytes(shape, r, moe=model.is_moe_layer(i)) for i, r in kinds if r != "full")
    total += built.recompute_groups * layer_activation_bytes(shape, recompute="full")
    if built.first:
        total += embedding_activation_bytes(shape)
    if built.last:
        total += head_activation_bytes(shape)
    if built.last and model.mtp_depth:  # selective recomputation reaches the modules' blocks, full does not
        recompute = "selective" if "selective" in built.recompute else "none"
        total += mtp_activation_bytes(shape, model.mtp_depth, recompute, moe=model.is_moe_layer(model.num_layers - 1))
    moe = any(model.is_moe_layer(i) for i in built.layer_ids)  # a recomputed group's largest block
    working = built.recompute_group * layer_activation_bytes(shape, recompute="none", moe=moe)
    return total / max(len(built.stage_ids), 1), working


def plan_layout(
    cfg: Config,
    world_size: int | None = None,
    *,
    tflops: float = 140.0,
    tokens: float = 300e9,
    nvlink_gbps: float = links.NVLINK_GBPS,
    ib_gbps: float = links.INFINIBAND_GBPS,
    gpu_memory_gib: float = 80.0,
    dp_ranks=(0,),
    all_ranks: bool = False,
    fused_attention: bool = False,
) -> Plan:
    """Plan `cfg` at `world_size` GPUs; raises LayoutError listing why a layout is impossible.

    fused_attention: plan for an SDPA kernel that keeps no a·s×s scores (flash, memory-efficient;
    what torch picks on recent GPUs); by default Korthikanti's unfused core, an upper bound.
    """
    world_size = world_size or default_world_size(cfg)
    vocab, vocab_note = tokenizer_vocab_size(cfg)
    errors = layout_errors(cfg, world_size, vocab)
    if errors:
        raise LayoutError(errors)
    padded = padded_vocabulary(cfg, vocab)
    dims = ParallelDims.from_config(cfg, world_size)
    m, t, p = cfg.model, cfg.training, cfg.parallel
    low = low_precision(cfg)
    compute_bytes = 2 if low else 4
    v = p.virtual_pipeline_stages_per_rank
    batches = BatchSizeSchedule(t, m.seq_length)
    micro, micro0 = (num_microbatches(cfg, dims.dp, size) for size in (batches.final, batches.start))
    # Activations peak at the final batch, except under interleaving, where a ramp-up count that pp
    # does not divide runs in longer rounds: the peak over every count of the run.
    counts = sorted({num_microbatches(cfg, dims.dp, size) for size in batches.sizes()})
    reshard = fsdp_reshards_after_forward(cfg)
    shape = ActivationShape.for_config(cfg, padded, dims.tp, dims.cp, scores_kept=not fused_attention)

    built_ranks, builds = build_ranks(cfg, world_size, padded, dp_ranks=dp_ranks, all_ranks=all_ranks)
    layout = comm.CommLayout.from_config(cfg, world_size, padded)
    ranks = []
    for rank, (pp_rank, dp_rank, tp_rank), b, built_as in built_ranks:
        states = pm.state_bytes(
            b.local, b.gathered, b.largest_unit, compute_bytes=compute_bytes,
            grad_bytes=4 if grads_reduced_in_fp32(cfg) else compute_bytes, fsdp=dims.fsdp_enabled,
            pipelined=dims.pp_enabled, reshard_after_forward=reshard, accumulates=micro > 1,
            compute_copy=uses_compute_copy(cfg, dims),
            state_per_param=pm.optimizer_bytes(cfg.optimizer.optimizer, cfg.optimizer.sgd_momentum, b.local_muon / max(b.local, 1)),
        )  # fmt: skip
        in_flight = max(pm.chunks_in_flight(p.pipeline_schedule, dims.pp, pp_rank, len(b.stage_ids), n) for n in counts)
        chunk, working = _activation_bytes(b, shape, m)
        boundary = shape.sbh / shape.sp_divisor * (shape.residual_bytes or shape.compute_bytes)
        pipeline = pm.pipeline_buffers(b.stage_ids, num_pipeline_stages(cfg)) * boundary
        memory = {**asdict(states), "activations": in_flight * chunk + working, "pipeline": pipeline}
        # Muon's step, after backward freed the activations: what it holds beyond them (dtgpt.plan.comm_muon)
        shard_rank = dp_rank % dims.dp_shard * dims.cp
        muon = comm_muon.step_bytes(layout, b.stage_ids, comm.block_shapes, shard_rank)
        memory["muon_step"] = max(0.0, muon - memory["activations"] - pipeline)
        memory = {k: val / pm.GIB for k, val in memory.items()}
        memory["total"] = sum(memory.values())
        ranks.append(RankPlan(
            rank, pp_rank, dp_rank, tp_rank, b.stage_ids, b.layer_ids, b.recompute.count("full"), b.local,
            b.stage_params, in_flight, memory, built_as,
        ))  # fmt: skip

    # Whole job: one row per pp rank (tp 0, dp 0) covers every stage once.
    heads = [r for r in ranks if r.tp_rank == 0 and r.dp_rank == dp_ranks[0]]
    # the last stage's copy of the word embedding (a tied head's, multi-token prediction's)
    tied_copy = padded * m.hidden_size if (dims.pp_enabled and (not m.untie_embeddings_and_output_weights or m.mtp_depth)) else 0
    total = sum(r.stage_params for r in heads) - tied_copy - mtp_parameters(m)
    recomputed = sum(r.recomputed_layers for r in heads)
    model_fpt = flops_per_token(m, padded)
    # A recomputed block costs one more forward of itself; MoE and dense blocks differ, so the mean.
    layer_fpt = (model_fpt - mtp_flops_per_token(m, padded) - 6 * m.hidden_size * padded) / m.num_layers
    hw_fpt = pm.hardware_flops_per_token(model_fpt, recomputed, layer_fpt) + router_flops_per_token(m)
    tokens_per_iter = batches.final * m.seq_length
    plan = Plan(
        world_size=world_size,
        mesh={"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp, "vpp": v,
              "ep": dims.ep, "efsdp": dims.dp_shard * dims.cp // dims.ep},
        vocab_size=vocab, padded_vocab_size=padded, total_params=total,
        active_params=num_parameters(m, padded, active=True), mtp_params=mtp_parameters(m),
        microbatches=micro, microbatches_initial=micro0, microbatch_counts=counts,
        bubble_fraction=pm.bubble_fraction(p.pipeline_schedule, dims.pp, v, micro),
        bubble_fraction_initial=pm.bubble_fraction(p.pipeline_schedule, dims.pp, v, micro0),
        flops_per_token=model_fpt, hardware_flops_per_token=hw_fpt,
        flops_per_iteration=model_fpt * tokens_per_iter, tokens_per_iteration=tokens_per_iter,
        est_iteration_s=pm.training_seconds(tokens_per_iter, hw_fpt, world_size, tflops),
        est_days=pm.training_seconds(tokens, hw_fpt, world_size, tflops) / pm.SECONDS_PER_DAY,
        tflops=tflops, tokens=tokens, gpu_memory_gib=gpu_memory_gib, ranks=ranks, builds=builds,
    )  # fmt: skip
    plan.comm = [links.rank_traffic(layout, r, micro, nvlink_gbps, ib_gbps) for r in range(dims.pp)]
    plan.est_comm_s = max(t.seconds for t in plan.comm)
    plan.all_to_all_bytes = [
        sum(col.bytes for col in comm.rank_collectives(layout, r, micro) if col.kind == "all_to_all") for r in range(dims.pp)
    ]
    if vocab_note:
        plan.notes.append(vocab_note)
    if m.mtp_depth:
        plan.notes.append(
            "multi-token prediction: its modules' parameters, state memory, activations and collectives (an MoE block's "
            "experts' too) are counted on the last stage (dtgpt/plan/comm_mtp.py)"
        )
    expected = num_parameters(m, padded)
    if total != expected:
        plan.warnings.append(f"built model has {total:,} parameters, the closed form {expected:,}: a planner bug")
    plan.warnings += layout_warnings(cfg, plan, batches, dims)
    return plan
