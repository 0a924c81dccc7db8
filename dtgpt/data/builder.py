"""Which dataset each split gets, and how many samples each part is built with.

The rules of Megatron's BlendedMegatronDatasetBuilder, for n samples asked of a split:

- one prefix without a weight: a GPTDataset of n samples;
- weighted prefixes (one or more): component d is built with ceil(ceil(n * w_d) * 1.005) samples
  (0.5 % surplus so the blend never runs dry) and the blend holds sum_d ceil(n * w_d) >= n;
- several prefixes without weights: each component is one epoch, weighted by its number of
  samples, and the blend holds min(n, their total): it can be shorter than asked.

`data_path` is split by `data.split`; `train_data_path`/`valid_data_path`/`test_data_path` give a
split its own blend of whole datasets, where one prefix is a GPTDataset whatever its weight.
The stable order keeps dtgpt's earlier rules: one prefix is never blended, and prefixes without
weights weigh 1 each (no one-epoch cap).

A split that gets no tokens (a small corpus: 400 documents leave "949,50,1"'s test split none)
is never built (Megatron's builder would loop forever on it): for validation or test one note
line says so and that evaluation is skipped (a blend keeps its other components); for train it is
a DataError naming the split and the document count.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from dtgpt.config.split import SPLIT_NAMES, split_document_ranges
from dtgpt.config.blend import parse_blend
from dtgpt.data.blended import BlendedDataset, normalize
from dtgpt.data.cache import index_cache_dir, is_global_rank_zero
from dtgpt.data.gpt_dataset import GPTDataset
from dtgpt.data.indexed import DataError, IndexedDataset, check_token_ids

SURPLUS = 0.005
"""Each component of a weighted blend is built this much larger than its share (Megatron's 0.5 %)."""


def component_share(num_samples: int, weight: float) -> int:
    """Samples a weighted blend plans to draw from one component."""
    return int(math.ceil(num_samples * weight))


def component_size(num_samples: int, weight: float) -> int:
    """Samples to build from one component of a weighted blend: its share plus the surplus, rounded up."""
    return int(math.ceil(component_share(num_samples, weight) * (1 + SURPLUS)))


class _SplitBuilder:
    """Opens each prefix once and builds GPT datasets and blends with the shared settings."""

    def __init__(self, seq_length: int, seed: int, data_cache_path: str, vocab_size: Optional[int], order: str):
        self.seq_length, self.seed, self.data_cache_path = seq_length, seed, data_cache_path
        self.vocab_size, self.order = vocab_size, order
        self.indexed: dict[str, IndexedDataset] = {}

    def open(self, prefix: str) -> IndexedDataset:
        if prefix not in self.indexed:
            self.indexed[prefix] = IndexedDataset(prefix)
            if self.vocab_size is not None:
                check_token_ids(self.indexed[prefix], self.vocab_size)
        return self.indexed[prefix]

    def emptiness(self, prefix: str, document_range: tuple[int, int]) -> str | None:
        """Why this prefix's documents [lo, hi) give a split nothing to read, or None."""
        (lo, hi), total = document_range, len(self.open(prefix))
        if hi <= lo:
            return f"no documents of {total}"
        if not self.open(prefix).sequence_lengths[lo:hi].any():
            return f"no tokens in its {hi - lo} documents of {total}"
        return None

    def readable(self, name: str, source: str, prefixes: list[str], weights: Optional[list[float]],
                 ranges: list[tuple[int, int]]):
        """The components of a split that hold tokens, (prefixes, weights, ranges); None (after a
        note) for a validation or test split without any; a DataError for such a train split."""
        why = [self.emptiness(p, r) for p, r in zip(prefixes, ranges)]
        if not any(why):
            return prefixes, weights, ranges
        if len(prefixes) == 1:
            problem = f"the {name} split of {source} has {why[0]}"
        else:
            empty = ", ".join(f"{p} ({w})" for p, w in zip(prefixes, why) if w)
            problem = f"the {name} split of {source} gets nothing from {empty}"
        if name == "train":
            raise DataError(f"{problem}: nothing to train on; use more data or a larger train weight")
        keep = [i for i, w in enumerate(why) if not w]
        if not keep:
            _note(f"{problem}: no {'validation' if name == 'valid' else name} evaluation")
            return None
        _note(f"{problem}: the {name} blend is built from the other {len(keep)} of {len(prefixes)}")
        return [prefixes[i] for i in keep], weights and [weights[i] for i in keep], [ranges[i] for i in keep]

    def gpt(self, prefix: str, document_range: tuple[int, int], num_samples: Optional[int], name: str) -> GPTDataset:
        return GPTDataset(self.open(prefix), document_range, num_samples, self.seq_length, self.seed,
                          index_cache_dir(self.data_cache_path, prefix), name, self.vocab_size, self.order)

    def split(self, prefixes: list[str], weights: Optional[list[float]], ranges: list[tuple[int, int]],
              num_samples: int, name: str, blend_single: bool):
        """One split's dataset: a GPTDataset, or a BlendedDataset over one GPTDataset per prefix."""
        if self.order == "stable":
            weights, blend_single = weights or [1.0] * len(prefixes), False
        if len(prefixes) == 1 and not (blend_single and weights is not None):
            return self.gpt(prefixes[0], ranges[0], num_samples, name)
        cache_dir = index_cache_dir(self.data_cache_path, prefixes[0])
        if weights is None:
            parts = [self.gpt(p, r, None, name) for p, r in zip(prefixes, ranges)]
            lengths = [len(part) for part in parts]
            return BlendedDataset(parts, lengths, min(num_samples, sum(lengths)), cache_dir, name, self.order)
        weights = normalize(weights)
        parts = [self.gpt(p, r, component_size(num_samples, w), name) for p, w, r in zip(prefixes, weights, ranges)]
        size = sum(component_share(num_samples, w) for w in weights)
        return BlendedDataset(parts, weights, size, cache_dir, name, self.order)


def build_gpt_datasets(data_path: Sequence[str], split: str, per_split_paths: Sequence[Sequence[str]],
                       num_samples: Sequence[int], seq_length: int, seed: int, data_cache_path: str,
                       vocab_size: Optional[int] = None, order: str = "megatron") -> tuple:
    """(train, valid, test) from indexed datasets; None for a split with 0 samples or 0 weight.

    With `vocab_size` (the tokenizer's), token ids outside [0, vocab_size) are an error: checked
    on the first tokens of each file at once, and in every sample as it is read.
    """
    if data_path and any(per_split_paths):
        raise ValueError("set either data.data_path (split by data.split) or data.train_data_path/"
                         "valid_data_path/test_data_path, not both")
    builder = _SplitBuilder(seq_length, seed, data_cache_path, vocab_size, order)
    out = []
    if data_path:
        prefixes, weights = parse_blend(data_path)
        ranges = [split_document_ranges(split, len(builder.open(p))) for p in prefixes]
        for s, name in enumerate(SPLIT_NAMES):
            parts = None
            if num_samples[s] > 0 and ranges[0][s] is not None:
                parts = builder.readable(name, f'data.split="{split}"', prefixes, weights, [r[s] for r in ranges])
            out.append(builder.split(*parts, num_samples[s], name, True) if parts else None)
        return tuple(out)
    for s, name in enumerate(SPLIT_NAMES):
        paths = per_split_paths[s] if s < len(per_split_paths) else []
        parts = None
        if num_samples[s] > 0 and paths:
            prefixes, weights = parse_blend(paths, key=f"data.{name}_data_path")
            ranges = [(0, len(builder.open(p))) for p in prefixes]
            parts = builder.readable(name, f"data.{name}_data_path", prefixes, weights, ranges)
        out.append(builder.split(*parts, num_samples[s], name, False) if parts else None)
    return tuple(out)


def _note(message: str) -> None:
    """One line from global rank 0 (every rank builds the same splits and finds the same)."""
    if is_global_rank_zero():
        print(f"> note: {message}", flush=True)
