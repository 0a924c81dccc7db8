"""Plan a layout on a laptop: per-rank parameters and memory, bubble, FLOPs and training time.

Every distinct (pp rank, tp rank) of the job is built on the meta device under PyTorch's "fake"
process group at the job's full world size, through the same `build_parts()` -> `parallelize()`
code path that training runs (dtgpt.plan_ranks), so the parameter counts are those of the real
sharded DTensors. Nothing is allocated. Memory, bubble and time come from the formulas in
dtgpt.plan_memory.

    python scripts/plan.py --config configs/gpt3_175b.toml [--json] [--world-size N] [--check]
    python train.py --config configs/gpt3_175b.toml --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

from dtgpt import plan_memory as pm
from dtgpt.config import Config, ConfigError, apply_override, config_from_dict, load_toml, split_overrides, validate
from dtgpt.model import flops_per_token, num_parameters, padded_vocab_size
from dtgpt.optim import BatchSizeSchedule
from dtgpt.parallel import ParallelDims
from dtgpt.plan_ranks import BuiltRank, build_ranks
from dtgpt.plan_report import format_plan, layout_warnings

GPT2_VOCAB_SIZE = 50257


class LayoutError(ConfigError):
    """The layout cannot run at all; `errors` lists every rule it breaks that the planner found."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass
class RankPlan:
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    stage_ids: list[int]
    layer_ids: list[int]
    recomputed_layers: int
    local_params: int
    """What this GPU holds: sum of p.to_local().numel() (the tp shard, and the dp shard under FSDP)."""
    stage_params: int
    """Full (unsharded) size of this rank's stages, the tied copy included."""
    in_flight: int
    memory: dict[str, float] = field(default_factory=dict)
    """GiB per term: params, copies, grads, adam, activations, total."""
    built_as: int = -1
    """The global rank whose build this row reuses (itself when built)."""

    @property
    def layers(self) -> int:
        return len(self.layer_ids)

    @property
    def memory_gib(self) -> float:
        return self.memory["total"]


@dataclass
class Plan:
    world_size: int
    mesh: dict[str, int]
    vocab_size: int
    padded_vocab_size: int
    total_params: int
    microbatches: int
    microbatches_initial: int
    bubble_fraction: float
    bubble_fraction_initial: float
    flops_per_token: float
    hardware_flops_per_token: float
    flops_per_iteration: float
    tokens_per_iteration: int
    est_iteration_s: float
    est_days: float
    tflops: float
    tokens: float
    gpu_memory_gib: float
    ranks: list[RankPlan]
    builds: int
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(r.memory_gib <= self.gpu_memory_gib for r in self.ranks)

    def to_dict(self) -> dict:
        out = asdict(self)
        for row, rank in zip(out["ranks"], self.ranks):
            row["layers"] = rank.layers
            row["memory_gib"] = rank.memory_gib
        out["fits"] = self.fits
        return out


# -- inputs ------------------------------------------------------------------------------------


def tokenizer_vocab_size(cfg: Config) -> tuple[int, str | None]:
    """The tokenizer's vocabulary as training will see it, without loading the tokenizer.

    Mirrors dtgpt.data.build_tokenizer; returns (size, a note when it had to assume).
    """
    d = cfg.data
    if (d.builtin_corpus and not d.mock_data) or d.tokenizer_type == "ByteTokenizer":
        return 257, None
    if d.tokenizer_type == "NullTokenizer":
        return d.vocab_size, None
    if d.mock_data and not d.vocab_file and not d.merge_file:
        return d.vocab_size or GPT2_VOCAB_SIZE, None
    if d.vocab_file and os.path.isfile(d.vocab_file):
        with open(d.vocab_file, encoding="utf-8") as f:
            return len(json.load(f)), None
    return GPT2_VOCAB_SIZE, f"data.vocab_file={d.vocab_file!r} not found: assuming GPT-2's {GPT2_VOCAB_SIZE} tokens"


def default_world_size(cfg: Config) -> int:
    """pp * dp_replicate * dp_shard * tp, with dp_shard = -1 ("the rest") taken as 1."""
    p = cfg.parallel
    dps = p.data_parallel_shard_size if p.data_parallel_shard_size > 0 else 1
    return p.pipeline_model_parallel_size * p.data_parallel_replicate_size * dps * p.tensor_model_parallel_size


def layout_errors(cfg: Config, world_size: int, padded_vocab: int) -> list[str]:
    """Why this layout cannot run at all (empty when it can): the config and mesh rules."""
    errors = []
    try:
        validate(cfg, world_size)  # includes the torch.compile rule
    except ConfigError as e:
        errors.append(str(e))
    tp = cfg.parallel.tensor_model_parallel_size
    if padded_vocab % tp:
        errors.append(
            f"parallel.tensor_model_parallel_size={tp} must divide the padded vocabulary {padded_vocab}; "
            f"choose model.make_vocab_size_divisible_by as a multiple of {tp}"
        )
    return errors


# -- the plan ----------------------------------------------------------------------------------


def _activation_bytes(built: BuiltRank, shape: pm.ActivationShape, compute_bytes: int) -> tuple[float, float]:
    """(bytes per chunk in flight averaged over the rank's stages, recompute working set)."""
    total = sum(pm.layer_activation_bytes(shape, recompute=r) for r in built.recompute)
    if built.first:
        total += pm.embedding_activation_bytes(shape)
    if built.last:
        total += pm.head_activation_bytes(shape, compute_bytes)
    working = built.recompute_group * pm.layer_activation_bytes(shape, recompute="none")
    return total / max(len(built.stage_ids), 1), working


def plan_layout(
    cfg: Config,
    world_size: int | None = None,
    *,
    tflops: float = 140.0,
    tokens: float = 300e9,
    gpu_memory_gib: float = 80.0,
    dp_ranks=(0,),
    all_ranks: bool = False,
) -> Plan:
    """Plan `cfg` at `world_size` GPUs; raises LayoutError listing why a layout is impossible."""
    world_size = world_size or default_world_size(cfg)
    vocab, vocab_note = tokenizer_vocab_size(cfg)
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by)
    errors = layout_errors(cfg, world_size, padded)
    if errors:
        raise LayoutError(errors)
    dims = ParallelDims.from_config(cfg, world_size)
    m, t, p = cfg.model, cfg.training, cfg.parallel
    low = t.fp16 or t.bf16
    compute_bytes = 2 if low else 4
    v = p.virtual_pipeline_stages_per_rank
    batches = BatchSizeSchedule(t)
    per_step = t.micro_batch_size * dims.dp
    micro, micro0 = batches.final // per_step, batches.start // per_step
    reshard_mode = p.fsdp_reshard_after_forward
    reshard = (not dims.pp_enabled) if reshard_mode == "default" else reshard_mode == "always"  # as parallelize()
    shape = pm.ActivationShape(
        m.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads, padded, dims.tp,
        p.sequence_parallel, bytes_scale=1.0 if low else 2.0,
    )  # fmt: skip

    built_ranks, builds = build_ranks(cfg, world_size, padded, dp_ranks=dp_ranks, all_ranks=all_ranks)
    ranks = []
    for rank, (pp_rank, dp_rank, tp_rank), b, built_as in built_ranks:
        states = pm.state_bytes(
            b.local, b.gathered, b.largest_unit, low_precision=low, fsdp=dims.fsdp_enabled,
            pipelined=dims.pp_enabled, reshard_after_forward=reshard,
        )  # fmt: skip
        in_flight = pm.chunks_in_flight(p.pipeline_schedule, dims.pp, pp_rank, len(b.stage_ids), micro)
        chunk, working = _activation_bytes(b, shape, compute_bytes)
        memory = {**asdict(states), "activations": in_flight * chunk + working}
        memory = {k: val / pm.GIB for k, val in memory.items()}
        memory["total"] = sum(memory.values())
        ranks.append(RankPlan(
            rank, pp_rank, dp_rank, tp_rank, b.stage_ids, b.layer_ids, b.recompute.count("full"), b.local,
            b.stage_params, in_flight, memory, built_as,
        ))  # fmt: skip

    # Whole job: one row per pp rank (tp 0, dp 0) covers every stage once.
    heads = [r for r in ranks if r.tp_rank == 0 and r.dp_rank == dp_ranks[0]]
    tied_copy = padded * m.hidden_size if (dims.pp_enabled and not m.untie_embeddings_and_output_weights) else 0
    total = sum(r.stage_params for r in heads) - tied_copy
    recomputed = sum(r.recomputed_layers for r in heads)
    model_fpt = flops_per_token(m, padded)
    layer_fpt = pm.layer_flops_per_token(m.hidden_size, m.ffn_size, m.seq_length)
    hw_fpt = pm.hardware_flops_per_token(model_fpt, recomputed, layer_fpt)
    tokens_per_iter = batches.final * m.seq_length
    plan = Plan(
        world_size=world_size,
        mesh={"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp, "vpp": v},
        vocab_size=vocab, padded_vocab_size=padded, total_params=total,
        microbatches=micro, microbatches_initial=micro0,
        bubble_fraction=pm.bubble_fraction(p.pipeline_schedule, dims.pp, v, micro),
        bubble_fraction_initial=pm.bubble_fraction(p.pipeline_schedule, dims.pp, v, micro0),
        flops_per_token=model_fpt, hardware_flops_per_token=hw_fpt,
        flops_per_iteration=model_fpt * tokens_per_iter, tokens_per_iteration=tokens_per_iter,
        est_iteration_s=pm.training_seconds(tokens_per_iter, hw_fpt, world_size, tflops),
        est_days=pm.training_seconds(tokens, hw_fpt, world_size, tflops) / pm.SECONDS_PER_DAY,
        tflops=tflops, tokens=tokens, gpu_memory_gib=gpu_memory_gib, ranks=ranks, builds=builds,
    )  # fmt: skip
    if vocab_note:
        plan.notes.append(vocab_note)
    expected = num_parameters(m, padded)
    if total != expected:
        plan.warnings.append(f"built model has {total:,} parameters, the closed form {expected:,}: a planner bug")
    plan.warnings += layout_warnings(cfg, plan, batches, dims)
    return plan


# -- entry points ------------------------------------------------------------------------------


def main(cfg: Config, world_size: int | None = None, **options) -> int:
    """`train.py --dry-run`: print the plan; 0 when every rank fits, 1 when one does not,
    2 when the layout is impossible."""
    as_json = options.pop("as_json", False)
    try:
        plan = plan_layout(cfg, world_size, **options)
    except LayoutError as e:
        if as_json:
            print(json.dumps({"possible": False, "errors": e.errors}))
        else:
            print("\n".join(f"error: impossible layout: {err}" for err in e.errors))
        return 2
    print(json.dumps(plan.to_dict()) if as_json else format_plan(cfg, plan))
    return 0 if plan.fits else 1


def cli(argv: list[str]) -> int:
    """scripts/plan.py: --config F [--section.key=value ...] [--json] [--check] ..."""
    parser = argparse.ArgumentParser(prog="plan.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="TOML config file")
    parser.add_argument("--world-size", type=int, help="GPUs (default pp*dp_replicate*dp_shard*tp, dp_shard -1 as 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tflops", type=float, default=140.0, help="achieved TFLOP/s per GPU (default 140)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU (default 80)")
    parser.add_argument("--tokens", type=float, default=300e9, help="tokens to train, for the time (default 300e9)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a rank does not fit in --gpu-memory-gib")
    parser.add_argument("--all-ranks", action="store_true", help="build every pp rank, not one per kind of stage")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = config_from_dict(load_toml(args.config), args.config)
        for key, value in split_overrides(overrides):
            apply_override(cfg, key, value)
    except ConfigError as e:
        print(f"error: {e}")
        return 2
    code = main(
        cfg, args.world_size, as_json=args.json, tflops=args.tflops, tokens=args.tokens,
        gpu_memory_gib=args.gpu_memory_gib, all_ranks=args.all_ranks,
    )  # fmt: skip
    return code if args.check or code == 2 else 0
