"""The train/valid/test split rule (`data.split = "949,50,1"`), and which evaluations a config leaves data for.

Validation calls `parse_split` to check the string; the data code calls `split_document_ranges`
to turn it into document ranges. Both follow Megatron's `parse_and_normalize_split` and split
matrix: the weights are normalised, and split s holds documents
[round(start_s * N), round(end_s * N)) with start/end the cumulative fractions.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import numpy as np

from dtgpt.config.sections import Config, ConfigError, require

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """'949,50,1' -> [0.949, 0.05, 0.001]: up to three weights (',' or '/'), missing ones 0, normalised."""
    parts = [p for p in re.split(r"[,/]", split) if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"data.split={split!r} must be 1-3 non-negative numbers with a positive sum, "
                          "like '949,50,1'")
    weights += [0.0] * (3 - len(weights))
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def split_document_ranges(split: str, num_documents: int) -> list[Optional[tuple[int, int]]]:
    """Document range [lo, hi) of train, valid and test; None for a split of weight 0."""
    ranges: list[Optional[tuple[int, int]]] = []
    start = 0.0
    for fraction in parse_split(split):
        end = start + fraction  # Megatron accumulates the same floats in the same order
        ranges.append(None if end <= start else (int(round(start * num_documents)), int(round(end * num_documents))))
        start = end
    return ranges


def uses_split(cfg: Config) -> bool:
    """Whether data.split cuts the data: a data_path or the built-in corpus, not mock data (Megatron
    splits its mock documents 1,1,1 whatever --split says) nor per-split paths."""
    d = cfg.data
    return not d.mock_data and bool(d.data_path or d.builtin_corpus)


def check_validation_data(cfg: Config) -> None:
    """With eval.eval_iters > 0 there must be validation data. Megatron builds no validation set for a
    data.split of validation weight 0 ("100,0,0"), nor for per-split paths without
    data.valid_data_path, and then fails at its first evaluation with a traceback (get_batch calls
    next() on no iterator); dtgpt refuses both here, before anything runs. With eval.eval_iters = 0
    both train without evaluation, as in Megatron."""
    d, eval_iters = cfg.data, cfg.eval.eval_iters
    if eval_iters == 0:
        return
    if uses_split(cfg):
        require(parse_split(d.split)[1] > 0,
                f'data.split="{d.split}" gives the validation split weight 0, so there is no validation data for '
                f'eval.eval_iters={eval_iters}: give data.split a positive second weight (e.g. "99,1,0"), '
                f"or set eval.eval_iters=0 to train without evaluation")  # fmt: skip
    per_split = d.train_data_path or d.valid_data_path or d.test_data_path
    require(not per_split or bool(d.valid_data_path),
            f"data.valid_data_path is unset beside data.train_data_path, so there is no validation data for "
            f"eval.eval_iters={eval_iters}: set data.valid_data_path, or eval.eval_iters=0 to train without evaluation")  # fmt: skip


def no_test_note(cfg: Config) -> Optional[str]:
    """The note a run with evaluation prints when its config leaves no test split: Megatron then skips
    its test evaluation without a word (its test loader is None, so do_test is false)."""
    d = cfg.data
    if cfg.eval.eval_iters == 0:
        return None
    if uses_split(cfg) and parse_split(d.split)[2] == 0:
        return f'> note: the test split of data.split="{d.split}" has weight 0: no test evaluation'
    if d.train_data_path and not d.test_data_path:  # per-split paths (the data sources exclude each other)
        return "> note: data.test_data_path is unset: no test evaluation"
    return None
