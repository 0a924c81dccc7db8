"""Megatron-LM's `opt_param_scheduler` entry of common.pt (its OptimizerParamScheduler.state_dict):
written whole by `to-megatron`, and its weight-decay schedule followed on load.

Megatron's scheduler keeps lengths in samples, as dtgpt's LRSchedule does, so its values carry
over as they are. On load, its weight decay (start_wd, end_wd, wd_incr_steps, wd_incr_style) is
checked as Megatron's load_state_dict checks it: equal to the config's, unless
optimizer.override_opt_param_scheduler (the config's are kept) or
optimizer.use_checkpoint_opt_param_scheduler (the checkpoint's are taken). As for a dtgpt
checkpoint (resume_controls.weight_decay_values), the increment length is only compared where
the decay changes. The LR values are not checked here: the LR schedule resumes at num_steps.
"""

from __future__ import annotations

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.resume_controls import weight_decay_values
from dtgpt.config import Config
from dtgpt.optim import LRSchedule

WEIGHT_DECAY_FIELDS = ("start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")
"""Megatron's state-dict names of the weight-decay schedule (LRSchedule's attributes too), in the
order of resume_controls.weight_decay_values."""


def scheduler_state(cfg: Config, num_samples: int) -> dict:
    """Megatron's OptimizerParamScheduler.state_dict() for dtgpt's schedule `num_samples` in."""
    s = LRSchedule(cfg)
    return {
        "max_lr": s.max_lr, "min_lr": s.min_lr, "lr_warmup_steps": s.warmup_steps, "lr_decay_steps": s.decay_steps,
        "lr_decay_style": s.style, "num_steps": num_samples, **{name: getattr(s, name) for name in WEIGHT_DECAY_FIELDS},
    }  # fmt: skip


def follow_weight_decay(scheduler: dict, cfg: Config, schedule: LRSchedule) -> str | None:
    """Apply a Megatron checkpoint's weight-decay schedule to `schedule` by Megatron's rules
    (module docstring); a line for the log when the checkpoint's is taken. A scheduler saved
    before Megatron had one (no start_wd) leaves the config's."""
    if "start_wd" not in scheduler or cfg.optimizer.override_opt_param_scheduler:
        return None
    theirs = {name: scheduler[name] for name in WEIGHT_DECAY_FIELDS}
    if cfg.optimizer.use_checkpoint_opt_param_scheduler:
        for name, value in theirs.items():
            setattr(schedule, name, value)
        return "weight-decay schedule from the Megatron checkpoint (optimizer.use_checkpoint_opt_param_scheduler): " + ", ".join(
            f"{name} {value}" for name, value in theirs.items())  # fmt: skip
    for name, (what, key, ours) in zip(WEIGHT_DECAY_FIELDS, weight_decay_values(cfg, schedule)):
        if ours is not None and ours != theirs[name]:  # None: a length that changes nothing (constant)
            raise CheckpointError(
                f"the weight decay schedule's {what} is {ours} here ({key}) but {theirs[name]} in the Megatron checkpoint: "
                "set optimizer.override_opt_param_scheduler=true to follow the config, or "
                "optimizer.use_checkpoint_opt_param_scheduler=true to follow the checkpoint"
            )
    return None
