"""What a load takes from a checkpoint, per Megatron's controls, and the LR schedule it resumes.

    checkpoint.finetune=true         weights only: iteration, samples, AdamW, LR schedule, loss
                                     scale and RNG start fresh (--finetune)
    checkpoint.load_optimizer=false  optimizer, LR schedule and loss scale start fresh; weights,
                                     iteration, samples and RNG are loaded (--no-load-optim)
    checkpoint.load_rng=false        the generators keep their fresh seeding (--no-load-rng)

A checkpoint saved with checkpoint.save_optimizer=false (--no-save-optim) holds no optimizer state,
LR schedule or loss scale: a resume from it is planned as with checkpoint.load_optimizer=false. One
saved with checkpoint.save_rng=false (--no-save-rng) holds no generator states: as checkpoint.load_rng=false.
With checkpoint.exit_on_missing_checkpoint (--exit-on-missing-checkpoint), a load directory holding no
checkpoint is an error even where the run would otherwise start from scratch (it is the save directory).
With checkpoint.pretrained_checkpoint (--pretrained-checkpoint), a load directory holding none yet makes
the run fine-tune from that checkpoint instead.

A loaded LR schedule is checked as Megatron's OptimizerParamScheduler checks it: its peak and
minimum LR (and the embedding and output layer's, optimizer.decoupled_lr), warmup and decay
lengths (samples), decay style and weight-decay schedule (start, end, increment style and
length) must equal the config's, unless
optimizer.override_opt_param_scheduler (the config's are used) or
optimizer.use_checkpoint_opt_param_scheduler (the checkpoint's are used).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

from torch.distributed.checkpoint.metadata import Metadata

from dtgpt.checkpoint.layout import POINTER, CheckpointError
from dtgpt.checkpoint.stored import has_section
from dtgpt.config import CheckpointConfig, Config
from dtgpt.config.decoupled_lr_rules import embedding_output_bounds
from dtgpt.config.derived import lr_decay_length, lr_warmup_length, wd_incr_length
from dtgpt.optim import WD_MULT, LRSchedule, schedule_change
from dtgpt.state import TrainState


class LoadPlan(NamedTuple):
    optimizer: bool
    """Load the optimizer state, the LR schedule and the loss scale."""
    sections: tuple[str, ...]
    """The TrainState.STATEFUL sections to read."""
    rng: bool


def load_plan(c: CheckpointConfig, resumable: bool) -> LoadPlan:
    """What to read, from the checkpoint keys (a bare model of the library API has no schedule,
    loss scale or progress of ours: only weights, AdamW state and RNG)."""
    optimizer = c.load_optimizer and not c.finetune
    if c.finetune or not resumable:
        return LoadPlan(optimizer, (), False)
    sections = ("train_state", "lr_schedule", "loss_scaler") if optimizer else ("train_state",)
    return LoadPlan(optimizer, sections, c.load_rng)


def fit_to_checkpoint(plan: LoadPlan, metadata: Metadata) -> tuple[LoadPlan, list[str]]:
    """The plan for what a checkpoint holds, and a line for the log about each part it lacks: one
    saved without its optimizer is loaded as with load_optimizer=false, one without its generator
    states as with load_rng=false."""
    notes = []
    if plan.optimizer and has_section(metadata, "train_state") and not has_section(metadata, "lr_schedule"):
        plan = plan._replace(optimizer=False, sections=tuple(s for s in plan.sections if s == "train_state"))
        notes.append("the checkpoint was saved without its optimizer (checkpoint.save_optimizer=false): fresh optimizer "
                     "state, LR schedule and loss scale, as checkpoint.load_optimizer=false")  # fmt: skip
    if plan.rng and has_section(metadata, "train_state") and not has_section(metadata, "rng"):
        plan = plan._replace(rng=False)
        notes.append("the checkpoint was saved without its generator states (checkpoint.save_rng=false): they keep "
                     "their fresh seeding, as checkpoint.load_rng=false")  # fmt: skip
    return plan, notes


def resume_root(c: CheckpointConfig) -> str:
    """The directory a run resumes from: checkpoint.load, or under auto_resume checkpoint.save ("": none)."""
    return c.load or (c.save if c.auto_resume else "")


def pretrained_start(cfg: Config) -> Config:
    """Megatron's --pretrained-checkpoint: while the directory the run resumes from holds no
    checkpoint (no latest_checkpointed_iteration.txt), the config of a fine-tuning start from
    checkpoint.pretrained_checkpoint (weights only, as checkpoint.finetune); otherwise `cfg`."""
    c = cfg.checkpoint
    root = resume_root(c)
    if not c.pretrained_checkpoint or (root and (Path(root) / POINTER).exists()):
        return cfg
    start = dataclasses.replace(c, load=c.pretrained_checkpoint, finetune=True, auto_resume=False)
    return dataclasses.replace(cfg, checkpoint=start)


def start_from_scratch(c: CheckpointConfig, note: str) -> str:
    """The log line of a load that found no checkpoint where the run may start from scratch (the load
    directory is also the save directory, or auto_resume); an error under exit_on_missing_checkpoint."""
    if c.exit_on_missing_checkpoint:
        raise CheckpointError(f"{note}; checkpoint.exit_on_missing_checkpoint=true refuses to start from scratch: fix the path, or unset it")
    return f"{note}: starting from scratch"


def fresh_note(c: CheckpointConfig) -> str:
    """What a load left fresh, for its log line."""
    if c.finetune:
        return " (checkpoint.finetune: weights only; iteration, optimizer, LR schedule and RNG start fresh)"
    return "" if c.load_optimizer else " (checkpoint.load_optimizer=false: fresh optimizer, LR schedule and loss scale)"


def scheduler_values(cfg: Config) -> list[tuple[str, str, object]]:
    """(what, the key that sets it, value) for each value Megatron's scheduler checks on load."""
    schedule, o = LRSchedule(cfg), cfg.optimizer
    return [
        ("learning rate", "optimizer.lr", schedule.max_lr),
        ("minimum learning rate", "optimizer.min_lr", schedule.min_lr),
        ("warmup samples", lr_warmup_length(cfg).key, schedule.warmup_steps),
        ("decay samples", lr_decay_length(cfg).key, schedule.decay_steps),
        ("learning rate decay style", "optimizer.lr_decay_style", schedule.style),
        # Megatron keeps these in its optimizer's param groups; the effective values are compared
        ("embedding and output layer's peak and minimum learning rate", "optimizer.decoupled_lr", embedding_output_bounds(o)),
        *weight_decay_values(cfg, schedule),
    ]


def weight_decay_values(cfg: Config, schedule: LRSchedule) -> list[tuple[str, str, object]]:
    """Megatron's checked weight-decay values: start and end, increment style and length (the
    length only where the decay changes: under 'constant' it changes nothing, so a longer run
    keeps a constant decay without override_opt_param_scheduler)."""
    constant = schedule.wd_incr_style == "constant"
    start_key, end_key = ("optimizer.weight_decay",) * 2 if constant else ("optimizer.start_weight_decay", "optimizer.end_weight_decay")
    return [
        ("start weight decay", start_key, schedule.start_wd),
        ("end weight decay", end_key, schedule.end_wd),
        ("weight decay increment style", "optimizer.weight_decay_incr_style", schedule.wd_incr_style),
        ("weight decay increment samples", wd_incr_length(cfg).key, None if constant else schedule.wd_incr_steps),
    ]


def resume_schedule(saved: Config | None, cfg: Config, state: TrainState) -> str | None:
    """After the LR schedule's position was loaded: apply optimizer.override_opt_param_scheduler /
    use_checkpoint_opt_param_scheduler, or refuse a schedule that disagrees with the checkpoint's
    (CheckpointError naming the value). Returns a line for the log, or None. A checkpoint without
    its saved config (converted from elsewhere) has nothing to check against."""
    if saved is None:
        return None
    o, num_samples = cfg.optimizer, state.lr_schedule.num_samples
    if o.use_checkpoint_opt_param_scheduler:
        return _take_checkpoint_schedule(saved, state)
    if not o.override_opt_param_scheduler:
        for (what, key, ours), (_, saved_key, theirs) in zip(scheduler_values(cfg), scheduler_values(saved)):
            if ours != theirs:
                raise CheckpointError(
                    f"the LR schedule's {what} is {ours} here ({key}) but {theirs} in the checkpoint ({saved_key}): "
                    "set optimizer.override_opt_param_scheduler=true to follow the config, or "
                    "optimizer.use_checkpoint_opt_param_scheduler=true to follow the checkpoint"
                )
    return schedule_change(saved, cfg, num_samples)


def _take_checkpoint_schedule(saved: Config, state: TrainState) -> str:
    """Megatron's --use-checkpoint-opt_param-scheduler: the checked values come from the checkpoint."""
    ours, theirs = state.lr_schedule, LRSchedule(saved)
    ours.max_lr, ours.min_lr, ours.style = theirs.max_lr, theirs.min_lr, theirs.style
    ours.warmup_steps, ours.decay_steps = theirs.warmup_steps, theirs.decay_steps
    if theirs.decoupled is not None and ours.decoupled is None:  # the embedding and output are in the other groups
        raise CheckpointError(
            f"the checkpoint trained the word embedding and output layer at optimizer.decoupled_lr={saved.optimizer.decoupled_lr}: "
            "set optimizer.decoupled_lr to follow its schedule (optimizer.use_checkpoint_opt_param_scheduler)"
        )
    ours.decoupled = theirs.decoupled
    if ours.style == "WSD" and not ours.wsd_decay_steps:
        ours.wsd_decay_steps = theirs.wsd_decay_steps
    ours.start_wd, ours.end_wd = theirs.start_wd, theirs.end_wd
    ours.wd_incr_style, ours.wd_incr_steps = theirs.wd_incr_style, theirs.wd_incr_steps
    for optimizer in state.optimizer.optimizers:
        for group in optimizer.param_groups:  # a library user's own groups decay where they have weight decay
            group["weight_decay"] = ours.current_wd * group.get(WD_MULT, float(group["weight_decay"] != 0))
    values = ", ".join(f"{what} {value}" for what, _, value in scheduler_values(saved))
    return f"LR schedule from the checkpoint (optimizer.use_checkpoint_opt_param_scheduler): {values}"
