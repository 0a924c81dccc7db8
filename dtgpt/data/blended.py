"""Weighted blends of GPT datasets and the train/valid/test split, Megatron style.

`data_path = ["0.3", "prefA", "0.7", "prefB"]` blends two datasets 30/70 and splits each one by
`data.split`; `train_data_path`/`valid_data_path`/`test_data_path` give each split its own blend
(whole datasets, no split). A blend draws samples in the order of Megatron's greedy blending
index, from component datasets built 0.5% larger than their share so they never run dry.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import numpy as np

from dtgpt.data.cache import build_once, description_hash, index_cache_dir, load_npy, save_npy
from dtgpt.data.gpt_dataset import SPLIT_NAMES, GPTDataset, split_document_ranges
from dtgpt.data.indexed import IndexedDataset, check_token_ids

SURPLUS = 0.005
"""Each component of a blend is built this much larger than its share (Megatron's 0.5%)."""


def parse_blend(data_path: Sequence[str], key: str = "data.data_path") -> tuple[list[str], list[float]]:
    """Megatron's blend list -> (prefixes, normalised weights); datasets of weight 0 are dropped.

    ["0.3", "a", "0.7", "b"] is a weighted blend; ["a"] or ["a", "b"] weighs every prefix 1.
    An entry holding several words ("0.3 a 0.7 b") counts as those words.
    """
    items = [word for entry in data_path for word in str(entry).split()]
    if not items:
        raise ValueError(f"{key} is empty")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if not any(is_number(s) for s in items):
        prefixes, weights = items, [1.0] * len(items)
    elif len(items) % 2 == 0 and all(is_number(s) for s in items[0::2]) and not any(is_number(s) for s in items[1::2]):
        prefixes, weights = items[1::2], [float(s) for s in items[0::2]]
    else:
        raise ValueError(f"{key}={list(data_path)!r} must be prefixes, or weight/prefix pairs like ['0.3', 'a', '0.7', 'b']")
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{key}={list(data_path)!r}: weights must be finite, >= 0, with a positive sum")
    kept = [(p, w) for p, w in zip(prefixes, weights) if w > 0]
    total = np.sum(np.asarray([w for _, w in kept], dtype=np.float64))
    return [p for p, _ in kept], [float(w / total) for _, w in kept]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy blend: sample n comes from the dataset furthest behind its target share
    `weight * (n + 1)` (ties to the lower index); returns (dataset index, sample index in it).

    Megatron's helper measures against `weight * max(n, 1)`, one step behind, which lets a small
    dataset trail its share by up to ~1.3 samples; the target after the pick keeps every dataset
    within one sample of its share at every step. The loop is sequential by nature (each pick
    depends on all earlier ones): about a microsecond per sample in Python, and the result is cached.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    others = range(1, len(w))
    for n in range(size):
        t = float(n + 1)
        best, best_error = 0, w[0] * t - counts[0]
        for d in others:
            error = w[d] * t - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[n] = best
        sample_index[n] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


def component_size(num_samples: int, weight: float) -> int:
    """Samples to build from one component of a blend: its share plus the surplus, rounded up."""
    return int(math.ceil(math.ceil(num_samples * weight) * (1 + SURPLUS)))


class BlendedDataset:
    """`size` samples drawn from `datasets` in the greedy blending order."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, cache_dir: Optional[str],
                 split_name: str = "train"):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= np.iinfo(np.int16).max:
            raise ValueError(f"a blend holds at most {np.iinfo(np.int16).max - 1} datasets, got {len(datasets)}")
        w = np.asarray(weights, dtype=np.float64)
        self.datasets, self.weights, self.size, self.split_name = list(datasets), (w / w.sum()).tolist(), size, split_name
        self.description = {
            "class": "BlendedDataset", "format": 1, "split": split_name, "size": size, "weights": self.weights,
            "datasets": [getattr(d, "description", None) for d in self.datasets],
        }
        self._paths = None
        if cache_dir is None or any(d is None for d in self.description["datasets"]):
            self._set_arrays(*build_blending_indices(self.weights, size))
        else:
            stem = os.path.join(cache_dir, f"{description_hash(self.description)}-BlendedDataset-{split_name}")
            self._paths = (f"{stem}-dataset_index.npy", f"{stem}-dataset_sample_index.npy")

            def build() -> None:
                for path, array in zip(self._paths, build_blending_indices(self.weights, size)):
                    save_npy(path, array)

            build_once(lambda: all(os.path.isfile(p) for p in self._paths), build)
            self._set_arrays(*(load_npy(p) for p in self._paths))
        self._check_not_dry()

    def _set_arrays(self, dataset_index: np.ndarray, sample_index: np.ndarray) -> None:
        self.dataset_index = dataset_index.view(np.ndarray)
        self.dataset_sample_index = sample_index.view(np.ndarray)

    def _check_not_dry(self) -> None:
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (count, dataset) in enumerate(zip(counts, self.datasets)):
            if count > len(dataset):
                raise RuntimeError(f"blend component {d} of the {self.split_name} split needs {count} samples "
                                   f"but has {len(dataset)}")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._paths is not None:
            del state["dataset_index"], state["dataset_sample_index"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._paths is not None:
            self._set_arrays(*(load_npy(p) for p in self._paths))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for blended {self.split_name} dataset of {self.size}")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


def _build_split(prefixes: list[str], weights: list[float], ranges: list[tuple[int, int]], indexed: dict,
                 num_samples: int, seq_length: int, seed: int, data_cache_path: str, split_name: str,
                 vocab_size: Optional[int] = None):
    """One split: a GPTDataset for a single prefix, else a BlendedDataset over one per prefix."""
    def gpt(prefix: str, document_range: tuple[int, int], n: int) -> GPTDataset:
        return GPTDataset(indexed[prefix], document_range, n, seq_length, seed,
                          index_cache_dir(data_cache_path, prefix), split_name, vocab_size)

    if len(prefixes) == 1:
        return gpt(prefixes[0], ranges[0], num_samples)
    parts = [gpt(p, r, component_size(num_samples, w)) for p, w, r in zip(prefixes, weights, ranges)]
    return BlendedDataset(parts, weights, num_samples, index_cache_dir(data_cache_path, prefixes[0]), split_name)


def build_gpt_datasets(data_path: Sequence[str], split: str, per_split_paths: Sequence[Sequence[str]],
                       num_samples: Sequence[int], seq_length: int, seed: int, data_cache_path: str,
                       vocab_size: Optional[int] = None) -> tuple:
    """(train, valid, test) from indexed datasets; None for a split with 0 samples or 0 weight.

    With `vocab_size` (the tokenizer's), token ids outside [0, vocab_size) are an error: checked
    on the first tokens of each file at once, and in every sample as it is read.
    """
    if data_path and any(per_split_paths):
        raise ValueError("set either data.data_path (split by data.split) or data.train_data_path/"
                         "valid_data_path/test_data_path, not both")
    indexed: dict[str, IndexedDataset] = {}

    def open_all(prefixes: list[str]) -> None:
        for p in prefixes:
            if p not in indexed:
                indexed[p] = IndexedDataset(p)
                if vocab_size is not None:
                    check_token_ids(indexed[p], vocab_size)

    out = []
    if data_path:
        prefixes, weights = parse_blend(data_path)
        open_all(prefixes)
        ranges = [split_document_ranges(split, len(indexed[p])) for p in prefixes]
        for s, name in enumerate(SPLIT_NAMES):
            if num_samples[s] <= 0 or ranges[0][s] is None:
                out.append(None)
                continue
            out.append(_build_split(prefixes, weights, [r[s] for r in ranges], indexed, num_samples[s],
                                    seq_length, seed, data_cache_path, name, vocab_size))
        return tuple(out)
    for s, name in enumerate(SPLIT_NAMES):
        paths = per_split_paths[s] if s < len(per_split_paths) else []
        if num_samples[s] <= 0 or not paths:
            out.append(None)
            continue
        prefixes, weights = parse_blend(paths, key=f"data.{name}_data_path")
        open_all(prefixes)
        ranges = [(0, len(indexed[p])) for p in prefixes]
        out.append(_build_split(prefixes, weights, ranges, indexed, num_samples[s], seq_length, seed,
                                data_cache_path, name, vocab_size))
    return tuple(out)
