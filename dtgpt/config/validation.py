"""The rules a config must follow, checked once before any process group exists.

Every error names the key, the value and the rule.
"""

from __future__ import annotations

from typing import Any

from dtgpt.config.derived import (
    data_parallel_size,
    lr_decay_length,
    lr_warmup_length,
    lr_wsd_decay_length,
    mesh_shape,
    num_microbatches,
)
from dtgpt.config.batch_schedule import STEP_KEY, step_schedule, train_iterations
from dtgpt.config.blend import parse_blend
from dtgpt.config.decoupled_lr_rules import check_decoupled_lr
from dtgpt.config.weight_decay_keys import WEIGHT_DECAY_INCR_STYLES
from dtgpt.config.weight_decay_rules import check_apply_wd_to_qk_layernorm, check_weight_decay_schedule
from dtgpt.config.init_rules import check_init
from dtgpt.config.attention_rules import check_attention_variants
from dtgpt.config.mla_rules import check_mla
from dtgpt.config.mtp_rules import check_mtp
from dtgpt.config.muon_rules import MUON_OPTIMIZERS, check_muon
from dtgpt.config.output_paths import check_output_paths
from dtgpt.config.moe_rules import MOE_CHOICES, check_expert_mesh, check_moe
from dtgpt.config.parallel_rules import PIPELINE_SCHEDULES, check_parallelism, check_pipeline_microbatches
from dtgpt.config.precedence import check_conflicts
from dtgpt.config.ranges import check_ranges
from dtgpt.config.run_control_rules import check_run_controls
from dtgpt.config.recompute_rules import apply_moe_layer_recompute, check_recompute_modules
from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require
from dtgpt.config.split import check_validation_data, parse_split, uses_split
from dtgpt.config.tokenizer_rules import TOKENIZER_TYPES, check_tokenizer_config


_CHOICES = {
    "model.position_embedding_type": ("learned_absolute", "rope"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.dropout_rng": ("megatron", "layout_invariant"),
    "training.recompute_granularity": (None, "full", "selective"),  # None: no recomputation
    "training.recompute_method": (None, "uniform", "block"),
    "training.device": ("auto", "cpu", "cuda"),
    "training.nan_policy": ("skip", "stop"),
    "optimizer.optimizer": ("adam", "sgd", *MUON_OPTIMIZERS),
    "optimizer.lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    "optimizer.lr_wsd_decay_style": ("linear", "cosine", "exponential", "minus_sqrt"),
    "optimizer.weight_decay_incr_style": WEIGHT_DECAY_INCR_STYLES,
    "parallel.pipeline_schedule": PIPELINE_SCHEDULES,
    "parallel.fsdp_reshard_after_forward": ("default", "always", "never"),
    "data.tokenizer_type": TOKENIZER_TYPES,
    "data.builtin_corpus": ("", "python-docstrings"),
    "data.order": ("megatron", "stable"),
    "distributed.backend": ("auto", "nccl", "gloo"),
    "faults.signal_name": ("SIGTERM", "SIGINT"),
    **MOE_CHOICES,
}

FAULT_RANKS = (
    "faults.kill_rank", "faults.kill_again_rank", "faults.raise_rank", "faults.hang_rank", "faults.signal_rank",
    "faults.disk_full_rank",
)  # fmt: skip

_POSITIVE = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.seq_length",
    "model.make_vocab_size_divisible_by",
    "training.micro_batch_size",
    "training.global_batch_size",
    "training.train_iters",
    "parallel.tensor_model_parallel_size",
    "parallel.pipeline_model_parallel_size",
    "parallel.data_parallel_replicate_size",
    "parallel.context_parallel_size",
    "parallel.virtual_pipeline_stages_per_rank",
    "logging.log_interval",
    "eval.eval_interval",
    "distributed.timeout_minutes",
)


def get_key(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)




def _check_model(cfg: Config) -> None:
    """Rules of model shape."""
    m = cfg.model
    _require(m.kv_channels >= 0, f"model.kv_channels={m.kv_channels} must be >= 0 (0 = hidden_size / heads)")
    _require(
        m.kv_channels > 0 or m.hidden_size % m.num_attention_heads == 0,
        f"model.num_attention_heads={m.num_attention_heads} must divide model.hidden_size={m.hidden_size} "
        "(or set model.kv_channels)",
    )
    _require(
        not m.group_query_attention or (m.num_query_groups > 0 and m.num_attention_heads % m.num_query_groups == 0),
        f"model.num_query_groups={m.num_query_groups} must divide model.num_attention_heads={m.num_attention_heads}",
    )
    _require(
        0.0 < m.rotary_percent <= 1.0, f"model.rotary_percent={m.rotary_percent} must be in (0, 1]"
    )
    rotated = int(m.head_dim * m.rotary_percent)
    _require(
        m.position_embedding_type != "rope" or (rotated > 0 and rotated % 2 == 0),
        f"model.position_embedding_type='rope' rotates rotary_percent * head size = {rotated} channels, "
        "which must be even and > 0",
    )
    _require(m.rope_scaling_factor >= 1.0, f"model.rope_scaling_factor={m.rope_scaling_factor} must be >= 1")
    _require(
        m.seq_length <= m.max_positions,
        f"model.seq_length={m.seq_length} must be <= model.max_position_embeddings={m.max_position_embeddings}",
    )
    _require(m.ffn_hidden_size >= 0, f"model.ffn_hidden_size={m.ffn_hidden_size} must be >= 0 (0 = 4*hidden)")
    try:
        dense = not m.num_experts or any(not m.is_moe_layer(i) for i in range(m.num_layers))
    except ValueError:  # a bad moe_layer_freq, which check_moe names
        dense = True
    _require(  # SwiGLU's default width rounds 8/3 x hidden down to a multiple of 64: 0 below hidden 24
        (m.ffn_size > 0 or not dense) and (not m.num_experts or m.expert_ffn_size > 0),
        f"model.ffn_hidden_size=0 with model.swiglu=true and model.hidden_size={m.hidden_size} gives an MLP of "
        "width 0 (8/3 x hidden, rounded down to a multiple of 64): set model.ffn_hidden_size",
    )
    _require(  # inverse frequencies base^(-2i/d): a base of 0 or 1 makes every step's loss non-finite or RoPE a no-op
        m.position_embedding_type != "rope" or m.rotary_base > 1, f"model.rotary_base={m.rotary_base} must be > 1 (RoPE's base)"
    )
    _require(not (m.squared_relu and m.swiglu), "model.squared_relu=true and model.swiglu=true: choose one activation (Megatron refuses both)")
    _require(
        not (m.squared_relu and m.num_experts),
        f"model.squared_relu=true with model.num_experts={m.num_experts}: dtgpt's experts are GeLU or SwiGLU; "
        "squared ReLU is for dense MLPs",
    )
    check_init(cfg)
    for key in ("model.hidden_dropout", "model.attention_dropout"):
        _require(0.0 <= get_key(cfg, key) < 1.0, f"{key}={get_key(cfg, key)} must be in [0, 1)")


def _check_batch_sizes(cfg: Config) -> None:
    """Rules of batch sizes."""
    t = cfg.training
    _require(
        t.global_batch_size % t.micro_batch_size == 0,
        f"training.micro_batch_size={t.micro_batch_size} must divide training.global_batch_size={t.global_batch_size}",
    )
    if t.rampup_batch_size:
        _require(
            len(t.rampup_batch_size) == 3,
            f"training.rampup_batch_size={t.rampup_batch_size} must be [start, increment, ramp_samples]",
        )
        start, incr, samples = t.rampup_batch_size
        _require(start > 0 and incr > 0 and samples >= 0, f"training.rampup_batch_size={t.rampup_batch_size} needs start > 0, increment > 0, samples >= 0")
        _require(
            start <= t.global_batch_size and (t.global_batch_size - start) % incr == 0,
            f"training.rampup_batch_size={t.rampup_batch_size}: global_batch_size={t.global_batch_size} - start "
            f"must be a non-negative multiple of the increment",
        )
    if t.step_batch_size_schedule:
        _check_step_schedule(cfg)
    if t.train_samples is not None:
        _check_sample_based(cfg)


def _check_step_schedule(cfg: Config) -> None:
    """Megatron's rules of the step schedule (its format's own rules: batch_schedule.py)."""
    t = cfg.training
    last = step_schedule(t, cfg.model.seq_length)[-1][1]
    schedule = f'{STEP_KEY}="{t.step_batch_size_schedule}"'
    _require(not t.rampup_batch_size, f"{schedule} and training.rampup_batch_size={t.rampup_batch_size} cannot both be set; keep one")
    _require(t.train_samples is not None, f"{schedule} needs sample-based training: set training.train_samples")
    _require(
        t.global_batch_size == last,
        f"training.global_batch_size={t.global_batch_size} must be the last batch size of {schedule} ({last}): "
        "the schedule sets the global batch (a config file's global_batch_size gives way to a schedule given "
        "on the command line)",
    )


def _check_sample_based(cfg: Config) -> None:
    """training.train_samples: the iteration-denominated LR keys are refused, as Megatron refuses them."""
    t, o = cfg.training, cfg.optimizer
    _require(t.train_samples > 0, f"training.train_samples={t.train_samples} must be > 0")
    for key in ("optimizer.lr_decay_iters", "optimizer.lr_wsd_decay_iters"):
        _require(get_key(cfg, key) is None, f"{key}={get_key(cfg, key)} counts iterations: under training.train_samples use {key[:-5]}samples")
    _require(o.lr_warmup_iters == 0, f"optimizer.lr_warmup_iters={o.lr_warmup_iters} counts iterations: under training.train_samples use optimizer.lr_warmup_samples")
    iterations = train_iterations(t, cfg.model.seq_length)
    _require(iterations > 0, f"training.train_samples={t.train_samples} is less than one global batch: no iteration to train")


def _check_precision(cfg: Config) -> None:
    """Rules of precision."""
    t = cfg.training
    o = cfg.optimizer
    _require(not (t.fp16 and t.bf16), "training.fp16=true and training.bf16=true cannot both be set")
    _require(
        t.fp16 or t.bf16 or not t.fp32_residual_connection,
        "training.fp32_residual_connection=true needs training.fp16 or training.bf16 (an fp32 run's residual stream is fp32 already)",
    )
    _require(t.bf16 or not t.grad_reduce_in_bf16, "training.grad_reduce_in_bf16=true needs training.bf16=true (it only changes a bf16 run)")
    _require(
        not (t.grad_reduce_in_bf16 and t.accumulate_allreduce_grads_in_fp32),
        "training.grad_reduce_in_bf16 and training.accumulate_allreduce_grads_in_fp32 cannot both be true: gradients are reduced in one dtype",
    )
    _require(
        o.loss_scale is None or o.loss_scale > 0,
        f"optimizer.loss_scale={o.loss_scale} must be > 0: it is a static fp16 loss scale (unset: dynamic scaling)",
    )
    _require(o.hysteresis >= 1, f"optimizer.hysteresis={o.hysteresis} must be >= 1")
    _require(o.loss_scale_window >= 1, f"optimizer.loss_scale_window={o.loss_scale_window} must be >= 1")


def _check_learning_rate(cfg: Config) -> None:
    """Rules of learning rate."""
    o = cfg.optimizer
    _require(o.lr >= 0 and o.min_lr >= 0, f"optimizer.lr={o.lr} and optimizer.min_lr={o.min_lr} must be >= 0")
    _require(o.min_lr <= o.lr, f"optimizer.min_lr={o.min_lr} must be <= optimizer.lr={o.lr}")
    _require(o.clip_grad >= 0, f"optimizer.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")
    for key in ("optimizer.lr_warmup_iters", "optimizer.lr_warmup_samples"):
        _require(get_key(cfg, key) >= 0, f"{key}={get_key(cfg, key)} must be >= 0")
    decay, warmup = lr_decay_length(cfg), lr_warmup_length(cfg)
    _require(decay.samples > 0, f"{decay.key}={decay.value} must be > 0: it sets the decay length")
    # Megatron asserts warmup < decay whatever the decay style.
    _require(
        warmup.samples < decay.samples,
        f"{warmup.key}={warmup.value} must be < the decay length {decay.key}={decay.value} "
        f"({warmup.samples:g} >= {decay.samples:g} samples; warmup < decay)",
    )
    if o.lr_decay_style == "WSD":
        anneal = lr_wsd_decay_length(cfg)
        _require(
            anneal is not None,
            "optimizer.lr_decay_style='WSD' needs the anneal length: set optimizer.lr_wsd_decay_iters "
            "or optimizer.lr_wsd_decay_samples",
        )
        _require(anneal.samples > 0, f"{anneal.key}={anneal.value} must be > 0 under optimizer.lr_decay_style='WSD'")
        _require(
            anneal.samples <= decay.samples - warmup.samples,
            f"{anneal.key}={anneal.value}: the WSD anneal ({anneal.samples:g} samples) must fit between the end "
            f"of warmup ({warmup.samples:g}) and the end of decay ({decay.samples:g})",
        )


def _check_data(cfg: Config) -> None:
    """Rules of data."""
    d = cfg.data
    has_data = d.mock_data or d.builtin_corpus or d.data_path or d.train_data_path
    _require(
        bool(has_data),
        "no training data: set data.data_path (or data.train_data_path), data.builtin_corpus, or data.mock_data=true",
    )
    _require(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0")
    check_tokenizer_config(cfg)
    train_weight = parse_split(d.split)[0]
    _require(
        not uses_split(cfg) or train_weight > 0 or cfg.training.train_iters == 0,
        f'data.split="{d.split}" gives the train split weight 0: training.train_iters={cfg.training.train_iters} '
        "needs a positive first weight",
    )
    for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(d, key):
            parse_blend(getattr(d, key), key=f"data.{key}")
    check_validation_data(cfg)


def _check_checkpoint_logging_faults(cfg: Config) -> None:
    """Rules of checkpoint and logging."""
    c = cfg.checkpoint
    for key in ("checkpoint.save_interval", "checkpoint.keep_last", "checkpoint.exit_interval", "checkpoint.load_iteration",
                "training.check_weight_hash_across_dp_replicas_interval"):
        _require(get_key(cfg, key) >= 0, f"{key}={get_key(cfg, key)} must be >= 0")
    retain = c.save_retain_interval
    _require(
        retain == 0 or (retain > 0 and c.save_interval > 0 and retain % c.save_interval == 0),
        f"checkpoint.save_retain_interval={retain} must be 0 or a positive multiple of checkpoint.save_interval="
        f"{c.save_interval} (as Megatron requires): the retained checkpoints are saves",
    )
    o = cfg.optimizer
    _require(
        not (o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler),
        "optimizer.override_opt_param_scheduler and optimizer.use_checkpoint_opt_param_scheduler cannot both be "
        "true: the LR schedule comes from the config or from the checkpoint",
    )
    _require(c.exit_duration_in_mins >= 0, f"checkpoint.exit_duration_in_mins={c.exit_duration_in_mins} must be >= 0")
    _require(cfg.eval.eval_iters >= 0, f"eval.eval_iters={cfg.eval.eval_iters} must be >= 0")
    _require(
        cfg.logging.timers_log_level in (0, 1, 2),
        f"logging.timers_log_level={cfg.logging.timers_log_level} must be 0, 1 or 2",
    )
    check_output_paths(cfg)

    _require(
        cfg.distributed.heartbeat_min_seconds > 0,
        f"distributed.heartbeat_min_seconds={cfg.distributed.heartbeat_min_seconds} must be > 0",
    )
    _require(
        not (cfg.faults.kill_during_save and cfg.faults.kill_during_step),
        "faults.kill_during_save and faults.kill_during_step cannot both be true: a rank dies once",
    )
    _require(
        cfg.distributed.roll_call_seconds >= 0,
        f"distributed.roll_call_seconds={cfg.distributed.roll_call_seconds} must be >= 0",
    )
    for key in FAULT_RANKS:
        _require(get_key(cfg, key) >= 0, f"{key}={get_key(cfg, key)} must be >= 0")
        at = key.replace("_rank", "_at_iteration")
        _require(get_key(cfg, at) >= 0, f"{at}={get_key(cfg, at)} must be >= 0 (0: never)")

    prof = cfg.profiling
    if prof.profile_step_start > 0 and prof.trace_dir:
        _require(
            prof.profile_step_end > prof.profile_step_start,
            f"profiling.profile_step_end={prof.profile_step_end} must be > profiling.profile_step_start={prof.profile_step_start}",
        )


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Check every rule that needs no process group; with world_size, the mesh rules too."""
    check_ranges(cfg)  # first: the rules below compare numbers, which must be finite and bounded
    for key, choices in _CHOICES.items():
        value = get_key(cfg, key)
        said = f"{key} is unset (none, null or empty); it must be" if value == "" else f"{key}={value!r} is not"  # none unsets a string key
        _require(value in choices, f"{said} one of: {', '.join(map(repr, choices))}")
    for key in _POSITIVE:
        value = get_key(cfg, key)
        _require(value > 0, f"{key}={value} must be > 0")
    check_conflicts(cfg)
    _check_model(cfg)
    apply_moe_layer_recompute(cfg)  # Megatron's older flag stands for two keys the rules below read
    check_parallelism(cfg)
    check_recompute_modules(cfg)
    check_moe(cfg)
    check_mla(cfg)
    check_mtp(cfg)
    check_attention_variants(cfg)
    _check_batch_sizes(cfg)
    _check_precision(cfg)
    _check_learning_rate(cfg)
    check_decoupled_lr(cfg)
    check_apply_wd_to_qk_layernorm(cfg)
    check_weight_decay_schedule(cfg)
    check_muon(cfg)
    _check_data(cfg)
    _check_checkpoint_logging_faults(cfg)
    check_run_controls(cfg)

    if world_size is not None:
        validate_mesh(cfg, world_size)


def validate_mesh(cfg: Config, world_size: int) -> None:
    """Rules that need the world size: the mesh product and the batch split over dp."""
    p, t = cfg.parallel, cfg.training
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dpr, dps = p.data_parallel_replicate_size, p.data_parallel_shard_size
    fixed = pp * dpr * cp * tp
    if dps == -1:
        _require(
            world_size % fixed == 0,
            f"world size {world_size} is not divisible by pipeline_model_parallel_size={pp} * "
            f"data_parallel_replicate_size={dpr} * context_parallel_size={cp} * tensor_model_parallel_size={tp} "
            f"= {fixed}; "
            f"launch a multiple of {fixed} ranks (e.g. torchrun --nproc-per-node {fixed}) or lower those sizes",
        )
    else:
        _require(dps > 0, f"parallel.data_parallel_shard_size={dps} must be > 0 or -1 (the rest)")
        _require(
            fixed * dps == world_size,
            f"world size {world_size} != pipeline_model_parallel_size={pp} * data_parallel_replicate_size={dpr} "
            f"* data_parallel_shard_size={dps} * context_parallel_size={cp} * tensor_model_parallel_size={tp} "
            f"= {fixed * dps}; "
            f"launch {fixed * dps} ranks, or set parallel.data_parallel_shard_size=-1 to take the rest",
        )
    check_expert_mesh(cfg, mesh_shape(cfg, world_size)[2])
    for key in FAULT_RANKS:
        _require(get_key(cfg, key) < world_size, f"{key}={get_key(cfg, key)} must be < the world size {world_size}")
    also = cfg.faults.kill_also_ranks
    _require(all(0 <= r < world_size for r in also), f"faults.kill_also_ranks={also}: each must be in [0, {world_size})")
    dp = data_parallel_size(cfg, world_size)
    batch_sizes = {"training.global_batch_size": t.global_batch_size}
    if t.rampup_batch_size:
        start, incr, _ = t.rampup_batch_size
        batch_sizes.update({"training.rampup_batch_size start": start, "training.rampup_batch_size increment": incr})
    for i, (_, size) in enumerate(step_schedule(t, cfg.model.seq_length)):
        batch_sizes[f"{STEP_KEY} batch {i + 1}"] = size
    for key, size in batch_sizes.items():
        num_microbatches(cfg, dp, size, key)  # raises when dp * micro_batch_size does not divide it
    check_pipeline_microbatches(cfg, dp)
