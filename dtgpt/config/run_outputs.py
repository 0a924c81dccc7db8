"""A run's logs follow its checkpoint: a config file names its logs after its run
(`runs/debug/metrics.jsonl` beside `checkpoint.save = "checkpoints/debug"`), so a command line
that moves checkpoint.save to another run (`--checkpoint.save=checkpoints/corpus`) moves the
file's logs with it (`runs/corpus/...`) instead of mixing two runs' metrics and TensorBoard
events in one folder. A log path the command line sets itself is kept as given.
"""

from __future__ import annotations

from pathlib import PurePath

from dtgpt.config.sections import Config

LOG_KEYS = ("logging.tensorboard_dir", "logging.metrics_file")
SAVE = "checkpoint.save"


def apply_logs_follow_checkpoint(cfg: Config, file_save: str, levels: dict[str, int], file_level: int) -> None:
    """In place: each log path of the file that holds the file's run name (the last part of its
    checkpoint.save) as a folder takes the name of the command line's checkpoint.save."""
    if not file_save or levels.get(SAVE) == file_level or not cfg.checkpoint.save:
        return
    old, new = PurePath(file_save).name, PurePath(cfg.checkpoint.save).name
    if old == new:
        return
    for key in LOG_KEYS:
        section, name = key.split(".")
        path = getattr(getattr(cfg, section), name)
        if levels.get(key) != file_level or not path:
            continue
        parts = PurePath(path).parts
        if old in parts[:-1] or (name == "tensorboard_dir" and old in parts):
            setattr(getattr(cfg, section), name, str(PurePath(*(new if p == old else p for p in parts))))
