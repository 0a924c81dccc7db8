"""The data pipeline: tokenizers, datasets of seq_length + 1 token samples, and the DP-aware loader.

The training loop calls exactly these three functions (the loader's module imports torch, so
preprocessing and the built-in corpus, which import this package, never pay for it):

    tokenizer = build_tokenizer(cfg.data)
    train, valid, test = build_datasets(cfg, tokenizer, (n_train, n_valid, n_test))
    loader = dtgpt.data.loader.build_data_loader(train, consumed_samples, batch_size_at, dp_rank, dp_size,
                                                 cfg.data.num_workers, TokenOptions.from_config(cfg.data, tokenizer.eod))

Where the samples come from, in order of precedence: `data.mock_data` (Megatron's mock data, no files),
`data.builtin_corpus` (stdlib docstrings, built and cached on first use), then `data.data_path`
(split by `data.split`) or `data.train_data_path`/`valid_data_path`/`test_data_path`.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from dtgpt.config import Config
from dtgpt.config.split import SPLIT_NAMES
from dtgpt.data.builder import build_gpt_datasets
from dtgpt.data.builtin import build_builtin_corpus
from dtgpt.data.cache import cache_root
from dtgpt.data.mock import build_mock_dataset
from dtgpt.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["build_tokenizer", "build_datasets", "Tokenizer"]


def build_datasets(cfg: Config, tokenizer: Tokenizer, num_samples: Sequence[int]) -> tuple[Optional[object], ...]:
    """(train, valid, test) datasets; item i of each is an int64 array of seq_length + 1 tokens.

    A split is None when it was asked for 0 samples or has weight 0 (in data.split, or no path).
    The sample order is Megatron's for the same data, seed, seq_length, split, blend and sample
    counts (`data.order = "megatron"`), or, with "stable", independent of the sample counts.
    Either way it never depends on the parallel layout.
    """
    d, seq_length, seed = cfg.data, cfg.model.seq_length, cfg.training.seed
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must be (train, valid, test), got {num_samples!r}")
    if d.mock_data:
        mock_cache = os.path.join(cache_root(d.data_cache_path), "GPTDataset_indices")
        return tuple(
            build_mock_dataset(s, n, seq_length, tokenizer.vocab_size, tokenizer.eod, seed, name, mock_cache)
            if n > 0 else None
            for s, (n, name) in enumerate(zip(num_samples, SPLIT_NAMES))
        )
    data_path = d.data_path
    per_split = (d.train_data_path, d.valid_data_path, d.test_data_path)
    if d.builtin_corpus:
        data_path, per_split = [build_builtin_corpus(cache_root(d.data_cache_path), d.builtin_corpus)], ([], [], [])
    if not data_path and not any(per_split):
        raise ValueError("no training data: set data.data_path (or data.train_data_path), "
                         "data.builtin_corpus, or data.mock_data=true")
    return build_gpt_datasets(data_path, d.split, per_split, num_samples, seq_length, seed, d.data_cache_path,
                              vocab_size=tokenizer.vocab_size, order=d.order)
