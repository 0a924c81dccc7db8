"""Quantities derived from a config: one helper each, used by validation and by every builder.

Validation (validation.py) calls these to check the rules; builders call them again and trust
the answer. A helper that can fail on values only known at run time (the tokenizer's vocabulary,
a ramp-up batch size) raises the same ConfigError that validation would.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from dtgpt.config.sections import Config, ConfigError


# ---------------------------------------------------------------------------------------------
# The mesh


def mesh_shape(cfg: Config, world_size: int) -> tuple[int, int, int, int, int]:
    """(pp, dp_replicate, dp_shard, cp, tp) with dp_shard = -1 resolved to the rest of the world."""
    p = cfg.parallel
    pp, dpr, tp = p.pipeline_model_parallel_size, p.data_parallel_replicate_size, p.tensor_model_parallel_size
    cp = p.context_parallel_size
    dps = p.data_parallel_shard_size
    if dps == -1:
        dps = world_size // (pp * dpr * cp * tp)
    return pp, dpr, dps, cp, tp


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """dp = dp_replicate * dp_shard: the ranks that read different samples (cp ranks share theirs)."""
    _, dpr, dps, _, _ = mesh_shape(cfg, world_size)
    return dpr * dps


def num_pipeline_stages(cfg: Config) -> int:
    p = cfg.parallel
    return p.pipeline_model_parallel_size * p.virtual_pipeline_stages_per_rank


def low_precision(cfg: Config) -> bool:
    """The model computes in fp16 or bf16 (over fp32 master weights)."""
    return cfg.training.fp16 or cfg.training.bf16


def grads_reduced_in_fp32(cfg: Config) -> bool:
    """Gradients accumulate and cross dp in fp32: fp32 runs, bf16 runs (Megatron forces it, unless
    grad_reduce_in_bf16) and fp16 runs with accumulate_allreduce_grads_in_fp32."""
    t = cfg.training
    if t.bf16:
        return not t.grad_reduce_in_bf16
    return not t.fp16 or t.accumulate_allreduce_grads_in_fp32


def fsdp_reshards_after_forward(cfg: Config) -> bool:
    """Whether FSDP frees gathered parameters after each forward ('always'); by default they are
    kept until the last micro-batch's backward, as Megatron's distributed optimizer keeps them."""
    return cfg.parallel.fsdp_reshard_after_forward == "always"


# ---------------------------------------------------------------------------------------------
# Batches


def layout_invariant_dropout(cfg: Config) -> bool:
    """Dropout is on and keyed on each token's index in the run (model.dropout_rng)."""
    m = cfg.model
    return m.dropout_rng == "layout_invariant" and (m.hidden_dropout > 0.0 or m.attention_dropout > 0.0)


def keys_on_token_index(cfg: Config) -> bool:
    """The model takes each token's index in the run: layout-invariant dropout and the MoE
    router's forced balance draw from hashes of it."""
    m = cfg.model
    return layout_invariant_dropout(cfg) or (m.moe_enabled and m.moe_router_force_load_balancing)


def num_microbatches(cfg: Config, dp: int, global_batch_size: int | None = None, key: str = "training.global_batch_size") -> int:
    """Micro-batches each data-parallel rank runs to make up a global batch of that size (by
    default training.global_batch_size; a ramp-up gives smaller ones first)."""
    if global_batch_size is None:
        global_batch_size = cfg.training.global_batch_size
    micro = cfg.training.micro_batch_size
    per_step = micro * dp
    if global_batch_size % per_step:
        raise ConfigError(
            f"{key}={global_batch_size} must be divisible by micro_batch_size={micro} * "
            f"data-parallel size {dp} = {per_step}"
        )
    return global_batch_size // per_step


def interleaved_round_size(microbatches: int, pp: int) -> int:
    """Micro-batches per round of an interleaved schedule: each rank runs a round through one
    of its stages, then the same round through the next (Megatron's
    microbatch_group_size_per_vp_stage).

    The rounds must be equal, at least pp long (shorter ones starve the pipeline), and as short
    as possible (a rank keeps about a round per stage in flight): the smallest divisor of the
    count that is >= pp, or every micro-batch in one round when there are fewer than pp.
    Wherever torch's interleaved schedules accept a count (rounds of count // (count // pp)),
    this is their round size.
    """
    if microbatches <= pp:
        return microbatches
    return next(size for size in range(pp, microbatches + 1) if microbatches % size == 0)


# ---------------------------------------------------------------------------------------------
# Vocabulary


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Pad the vocabulary to a multiple of `divisible_by` (never times tp: the model is mesh-free)."""
    return int(math.ceil(vocab_size / divisible_by) * divisible_by)


def null_tokenizer_ids(data_cfg) -> int:
    """The ids a NullTokenizer of `[data]` has before its eod (which comes after them, as
    Megatron's): data.vocab_size, except under mock data, where vocab_size is the whole
    vocabulary with the eod as its last id (so mock runs keep their vocabulary)."""
    return data_cfg.vocab_size - 1 if data_cfg.mock_data else data_cfg.vocab_size


def padded_vocabulary(cfg: Config, vocab_size: int) -> int:
    """The model's vocabulary rows for a tokenizer of `vocab_size`; tp must divide them (the
    output layer and the embedding are split by rows)."""
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by)
    tp = cfg.parallel.tensor_model_parallel_size
    if padded % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} must divide the padded vocabulary {padded}; "
            f"choose model.make_vocab_size_divisible_by as a multiple of {tp}"
        )
    return padded


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule lengths, in samples (Megatron's iteration keys times the final batch)


class Length(NamedTuple):
    """A schedule length in samples and the key that set it (for error messages)."""

    samples: float
    key: str
    value: float


def lr_decay_length(cfg: Config) -> Length:
    o, t = cfg.optimizer, cfg.training
    if o.lr_decay_samples is not None:
        return Length(o.lr_decay_samples, "optimizer.lr_decay_samples", o.lr_decay_samples)
    if o.lr_decay_iters is not None:
        return Length(o.lr_decay_iters * t.global_batch_size, "optimizer.lr_decay_iters", o.lr_decay_iters)
    if t.train_samples is not None:  # sample-based training decays over its samples, as Megatron
        return Length(t.train_samples, "training.train_samples", t.train_samples)
    return Length(t.train_iters * t.global_batch_size, "training.train_iters", t.train_iters)


def lr_warmup_length(cfg: Config) -> Length:
    """The one warmup key that is set (config/precedence.py refuses two), in samples."""
    o = cfg.optimizer
    if o.lr_warmup_fraction is not None:
        fraction = o.lr_warmup_fraction
        return Length(fraction * lr_decay_length(cfg).samples, "optimizer.lr_warmup_fraction", fraction)
    if o.lr_warmup_samples > 0:
        return Length(o.lr_warmup_samples, "optimizer.lr_warmup_samples", o.lr_warmup_samples)
    return Length(o.lr_warmup_iters * cfg.training.global_batch_size, "optimizer.lr_warmup_iters", o.lr_warmup_iters)


def lr_wsd_decay_length(cfg: Config) -> Length | None:
    """WSD's anneal length; None when neither key is set (validation refuses that under WSD)."""
    o = cfg.optimizer
    if o.lr_wsd_decay_samples is not None:
        return Length(o.lr_wsd_decay_samples, "optimizer.lr_wsd_decay_samples", o.lr_wsd_decay_samples)
    if o.lr_wsd_decay_iters is not None:
        samples = o.lr_wsd_decay_iters * cfg.training.global_batch_size
        return Length(samples, "optimizer.lr_wsd_decay_iters", o.lr_wsd_decay_iters)
    return None


def wd_incr_length(cfg: Config) -> Length:
    """The weight decay's increment length: the whole run, as Megatron-LM's
    get_optimizer_param_scheduler sets wd_incr_steps (train_samples, or train_iters x the final
    global_batch_size), whatever the LR decay length."""
    t = cfg.training
    if t.train_samples is not None:
        return Length(t.train_samples, "training.train_samples", t.train_samples)
    return Length(t.train_iters * t.global_batch_size, "training.train_iters", t.train_iters)


def weight_decay_bounds(cfg: Config) -> tuple[float, float]:
    """(start, end) weight decay: optimizer.weight_decay twice under the 'constant' style (as
    Megatron sets --start-weight-decay and --end-weight-decay from --weight-decay), else the keys."""
    o = cfg.optimizer
    if o.weight_decay_incr_style == "constant":
        return o.weight_decay, o.weight_decay
    return o.start_weight_decay, o.end_weight_decay
