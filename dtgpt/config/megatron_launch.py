"""Megatron's meanings that hold for a whole launch script, applied once the config is read.

- NaN checks: Megatron checks the loss and the gradients for NaN by default and stops the run on
  one (its rerun machinery raises), except under fp16 with dynamic loss scaling, where a
  non-finite gradient is the scaler's signal to skip the step (Megatron turns the check off
  there). `--no-check-for-nan-in-loss-and-grad` turns it off. dtgpt's `training.nan_policy`
  says the same: 'stop', or 'skip' (the iteration's update is not applied). A Megatron launch
  script (Megatron flags, no `--config`) that sets neither gets Megatron's default; a config
  file keeps dtgpt's ('skip').
- The loss: Megatron averages each micro-batch's per-token mean over the micro-batches unless
  `--calculate-per-token-loss` is given; dtgpt's `training.calculate_per_token_loss` defaults to
  true (every token of the global batch weighs the same). A launch script that does not give the
  flag gets Megatron's `false`, so an MTP run or one under `--eod-mask-loss` continues Megatron's
  loss (docs/schedules.md); a config file keeps dtgpt's.
- `--skip-train` (eval.skip_train): the optimizer state is not loaded, as Megatron turns on
  `--no-load-optim` then (nor is the LR schedule checked against the checkpoint's).
- `--no-position-embedding`: Megatron refuses it unless the positions are rotary (its own
  deprecation), where the model has no learned position table anyway; so does dtgpt.
"""

from __future__ import annotations

from dtgpt.config.megatron_tested import check_eval_batch
from dtgpt.config.megatron_vocab import megatron_launch
from dtgpt.config.sections import Config, ConfigError

NAN_KEY = "training.nan_policy"
PER_TOKEN_KEY = "training.calculate_per_token_loss"
NO_POSITION_EMBEDDING = "--no-position-embedding"


def megatron_nan_policy(cfg: Config) -> str:
    """What Megatron does on a non-finite loss or gradient norm with its checks at their default."""
    t = cfg.training
    return "skip" if t.fp16 and cfg.optimizer.loss_scale is None else "stop"


def apply_megatron_launch_rules(cfg: Config, spellings: list[str], ignored: list[str], levels: dict, has_file: bool) -> None:
    """In place: Megatron's NaN check and loss normalisation for a launch script; no optimizer load
    under skip_train; refuse --no-position-embedding without rope."""
    launch = megatron_launch(spellings, ignored, has_file)
    if launch and NAN_KEY not in levels:
        cfg.training.nan_policy = megatron_nan_policy(cfg)
    if launch and PER_TOKEN_KEY not in levels:
        cfg.training.calculate_per_token_loss = False
    check_eval_batch(cfg, ignored)
    if cfg.eval.skip_train:
        cfg.checkpoint.load_optimizer = False
    if NO_POSITION_EMBEDDING in ignored and cfg.model.position_embedding_type != "rope":
        raise ConfigError(
            f"{NO_POSITION_EMBEDDING} needs --position-embedding-type rope (model.position_embedding_type is "
            f"{cfg.model.position_embedding_type!r}): Megatron refuses it otherwise; choose the positions with "
            "--position-embedding-type"
        )
