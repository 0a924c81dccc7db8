"""A run's logs follow its checkpoint (dtgpt/config/run_outputs.py): a command line that moves a
config file's checkpoint.save to another run moves the file's log paths named after its run."""

from __future__ import annotations

from dtgpt.config import load_config

DEBUG = "configs/debug.toml"


def logs(cfg) -> tuple[str, str]:
    return cfg.logging.tensorboard_dir, cfg.logging.metrics_file


def test_logs_follow_a_checkpoint_moved_on_the_command_line():
    assert logs(load_config(DEBUG)) == ("runs/debug/tensorboard", "runs/debug/metrics.jsonl")
    moved = load_config(DEBUG, ["--checkpoint.save=checkpoints/corpus", "--checkpoint.load=checkpoints/corpus"])
    assert logs(moved) == ("runs/corpus/tensorboard", "runs/corpus/metrics.jsonl")
    megatron = load_config(DEBUG, ["--save", "/scratch/run7"])  # Megatron's flag, an absolute path
    assert logs(megatron) == ("runs/run7/tensorboard", "runs/run7/metrics.jsonl")


def test_log_paths_given_on_the_command_line_are_kept():
    cfg = load_config(DEBUG, ["--checkpoint.save=checkpoints/corpus", "--logging.metrics_file=mine.jsonl"])
    assert logs(cfg) == ("runs/corpus/tensorboard", "mine.jsonl")
    assert logs(load_config(DEBUG, ["--checkpoint.save=checkpoints/debug"])) == logs(load_config(DEBUG))
