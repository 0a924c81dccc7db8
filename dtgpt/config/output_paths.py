"""Paths a run writes, checked on every rank before any starts: one rank failing alone to create
its directory would strand the rest, and the OS's own error came as a traceback mid-start-up.

A directory the run creates (checkpoint.save, logging.tensorboard_dir, data.data_cache_path) must
not be a file, nor lie under one; the metrics file must not be a directory, nor lie under a file.
"""

from __future__ import annotations

import os

from dtgpt.config.sections import Config, ConfigError

DIRECTORIES = {
    "checkpoint.save": "checkpoints are a directory of iter_* directories",
    "logging.tensorboard_dir": "TensorBoard writes a directory of event files",
    "data.data_cache_path": "the dataset index cache is a directory",
}


def file_in_the_way(path: str) -> str | None:
    """The path itself or its nearest existing parent, when that is not a directory."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


def check_output_paths(cfg: Config) -> None:
    for key, why in DIRECTORIES.items():
        section, name = key.split(".")
        path = getattr(getattr(cfg, section), name)
        if path and (blocker := file_in_the_way(path)):
            raise ConfigError(f"{key}={path} {_is_or_lies_under(path, blocker)}: {why}")
    metrics = cfg.logging.metrics_file
    if metrics and os.path.isdir(metrics):
        raise ConfigError(f"logging.metrics_file={metrics} is a directory: name a file in it")
    if metrics and (blocker := file_in_the_way(os.path.dirname(os.path.abspath(metrics)))):
        raise ConfigError(f"logging.metrics_file={metrics} lies under {os.path.relpath(blocker)}, a file: name a file in a directory")


def _is_or_lies_under(path: str, blocker: str) -> str:
    if blocker == os.path.abspath(os.path.expanduser(path)):
        return "is a file"
    return f"lies under {os.path.relpath(blocker)}, a file"
