"""Rules of the keys that steer a run rather than define what it trains: the exit signal, the
iterations to skip (dtgpt/config/checkpoint_keys.py, training.iterations_to_skip)."""

from __future__ import annotations

from dtgpt.config.checkpoint_keys import EXIT_SIGNALS
from dtgpt.config.sections import Config, require


def check_run_controls(cfg: Config) -> None:
    signal = cfg.checkpoint.exit_signal
    require(
        signal in ("", *EXIT_SIGNALS),
        f"checkpoint.exit_signal={signal!r} is not one of {', '.join(EXIT_SIGNALS)} (empty: SIGTERM and SIGINT)",
    )
    bad = [i for i in cfg.training.iterations_to_skip if i < 1]
    require(not bad, f"training.iterations_to_skip={cfg.training.iterations_to_skip}: iterations count from 1, {bad[0] if bad else ''} is none")
