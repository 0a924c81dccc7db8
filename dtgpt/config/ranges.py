"""Range rules for every number in a config: finite floats, bounded integers, and the ranges
that make each optimizer and model setting meaningful.

A value out of range does not fail where it is read: `optimizer.lr=inf` turns the weights to
NaN at the first step, a seed of 2**40 overflows numpy's generator, a huge size overflows an
int64 product. So they are refused here, each naming the key, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import math

from dtgpt.config.sections import Config, ConfigError

INT_LIMIT = 2**31 - 1
"""Sizes, counts of iterations and ranks: every product of a few of them fits an int64."""
SAMPLES_LIMIT = 2**48
"""Counts of samples (`*_samples`): a sample index times seq_length still fits an int64."""
SEED_LIMIT = 2**32 - 1
"""numpy's generators (the data order) take seeds below 2**32."""

_UNIT_OPEN = ("optimizer.adam_beta1", "optimizer.adam_beta2", "optimizer.sgd_momentum", "optimizer.muon_momentum", "model.hidden_dropout", "model.attention_dropout")
"""Keys in [0, 1)."""
_POSITIVE_FLOAT = ("optimizer.adam_eps", "model.norm_epsilon", "optimizer.initial_loss_scale", "optimizer.min_loss_scale")


def _numbers(cfg: Config):
    """(dotted key, value) of every int and float in the config, list items included."""
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(sub):
            continue
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            key = f"{section.name}.{f.name}"
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, item in items:
                if isinstance(item, (int, float)) and not isinstance(item, bool):
                    yield (key if i is None else f"{key}[{i}]"), item


def range_problem(cfg: Config) -> str | None:
    """The first number of `cfg` out of its range, as one line; None when all are in range."""
    for key, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}={value} must be a finite number"
        if isinstance(value, int):
            limit = SEED_LIMIT if key == "training.seed" else SAMPLES_LIMIT if "_samples" in key else INT_LIMIT
            if abs(value) > limit:
                return f"{key}={value} is out of range (|value| <= {limit})"
    o, t = cfg.optimizer, cfg.training
    if not 0 <= t.seed:
        return f"training.seed={t.seed} must be >= 0"
    for key in _UNIT_OPEN:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not 0 <= value < 1:
            return f"{key}={value} must be in [0, 1)"
    for key in _POSITIVE_FLOAT:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not value > 0:
            return f"{key}={value} must be > 0"
    if o.lr_warmup_fraction is not None and not 0 <= o.lr_warmup_fraction < 1:
        return f"optimizer.lr_warmup_fraction={o.lr_warmup_fraction} must be in [0, 1) (warmup < decay)"
    if o.lr_warmup_init < 0:
        return f"optimizer.lr_warmup_init={o.lr_warmup_init} must be >= 0"
    if cfg.logging.peak_tflops < 0:
        return f"logging.peak_tflops={cfg.logging.peak_tflops} must be >= 0 (0: the device's own, from a table)"
    if t.exit_skipped_iters < 0:
        return f"training.exit_skipped_iters={t.exit_skipped_iters} must be >= 0 (0: never stop)"
    return None


def check_ranges(cfg: Config) -> None:
    problem = range_problem(cfg)
    if problem:
        raise ConfigError(problem)
