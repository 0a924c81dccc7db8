"""Blends of GPT datasets, Megatron style: the greedy blending index (the data_path grammar is
dtgpt/config/blend.py's, so that validation refuses a malformed blend before any process starts).

A blend draws sample n from the component furthest behind its target share. Which components a
split blends and how many samples each is built with is `builder.py`'s business.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from dtgpt.data.cache import build_once, description_hash, is_cached, load_npy, save_npy


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights over their sum, in float64 summed by numpy: Megatron's `normalize`, bit for bit."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def build_blending_indices(weights: Sequence[float], size: int, order: str = "megatron") -> tuple[np.ndarray, np.ndarray]:
    """Greedy blend: sample n comes from the dataset furthest behind its target share (ties to the
    lower index); returns (dataset index, sample index in it).

    The target is Megatron's `weight * max(n, 1)`; the stable order keeps dtgpt's earlier
    `weight * (n + 1)` (the share after the pick). The loop is sequential by nature (each pick
    depends on all earlier ones): about a microsecond per sample in Python, and the result is cached.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    others = range(1, len(w))
    ahead = 1 if order == "stable" else 0
    for n in range(size):
        t = float(max(n + ahead, 1))
        best, best_error = 0, w[0] * t - counts[0]
        for d in others:
            error = w[d] * t - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[n] = best
        sample_index[n] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` in the greedy blending order (weights normalised here)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, cache_dir: Optional[str],
                 split_name: str = "train", order: str = "megatron"):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= np.iinfo(np.int16).max:
            raise ValueError(f"a blend holds at most {np.iinfo(np.int16).max - 1} datasets, got {len(datasets)}")
        self.datasets, self.weights, self.size = list(datasets), normalize(weights), size
        self.split_name = split_name
        self.description = {
            "class": "BlendedDataset", "format": 2, "split": split_name, "size": size, "weights": self.weights,
            "order": order, "datasets": [getattr(d, "description", None) for d in self.datasets],
        }
        self._paths = None
        if cache_dir is None or any(d is None for d in self.description["datasets"]):
            self._set_arrays(*build_blending_indices(self.weights, size, order))
        else:
            stem = os.path.join(cache_dir, f"{description_hash(self.description)}-BlendedDataset-{split_name}")
            self._paths = (f"{stem}-dataset_index.npy", f"{stem}-dataset_sample_index.npy")

            def build() -> None:
                for path, array in zip(self._paths, build_blending_indices(self.weights, size, order)):
                    save_npy(path, array)

            build_once(lambda: is_cached(self._paths), build)
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
