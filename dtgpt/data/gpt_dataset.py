"""GPT samples of seq_length + 1 tokens over an indexed dataset, with Megatron's GPTDataset semantics.

Three index arrays (`gpt_indices.py`) order the samples, in Megatron's order or the stable one.
The arrays are cached as .npy files keyed by a hash of their inputs, built once by rank 0 and
memory-mapped.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from dtgpt.data.cache import build_once, description_hash, file_fingerprint, is_cached, load_npy, save_npy
from dtgpt.data.gpt_indices import ORDERS, build_gpt_indices, cache_key
from dtgpt.data.indexed import DataError, IndexedDataset, bin_path, idx_path

_ARRAYS = ("document_index", "sample_index", "shuffle_index")


class GPTDataset:
    """Samples of exactly seq_length + 1 tokens (int64) from documents [lo, hi) of an IndexedDataset
    (or any corpus with its `sequence_lengths`, `get` and `prefix`: the mock one, dtgpt.data.mock).

    Enough epochs are built for `num_samples` (None: one epoch, Megatron's None); `len()` covers
    every sample of those epochs (>= num_samples, as in Megatron). With `order="stable"` sample i
    is the same whatever num_samples was. With `cache_dir=None` the indices are built in memory
    and never written. With `vocab_size`, a sample holding an id outside [0, vocab_size) raises a
    DataError naming the file.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int, seq_length: int,
                 seed: int, cache_dir: Optional[str], split_name: str = "train", vocab_size: Optional[int] = None,
                 order: str = "megatron"):
        lo, hi = document_range
        if not 0 <= lo < hi <= len(indexed):
            raise ValueError(
                f"{indexed.prefix}: the {split_name} split has documents [{lo}, {hi}) of {len(indexed)}: "
                "no documents; use more data or a larger data.split weight"
            )
        if (num_samples is not None and num_samples < 1) or seq_length < 1:
            raise ValueError(f"num_samples={num_samples} and seq_length={seq_length} must be >= 1")
        if order not in ORDERS:
            raise ValueError(f"data.order={order!r} is not one of {ORDERS}")
        self.indexed, self.seq_length, self.split_name = indexed, seq_length, split_name
        self.vocab_size = vocab_size
        tokens_per_epoch = int(indexed.sequence_lengths[lo:hi].sum(dtype=np.int64))
        key = cache_key(max(tokens_per_epoch, 1), num_samples, seq_length, order)
        self.num_epochs = key["num_epochs"]

        def build() -> dict[str, np.ndarray]:
            docs = np.arange(lo, hi, dtype=np.int64)
            return build_gpt_indices(indexed.sequence_lengths, docs, num_samples, seq_length, seed, order)

        self._paths = None
        if cache_dir is None:
            self._set_arrays(build())
        else:
            self.description = {
                "class": "GPTDataset", "format": 3, **corpus_fingerprint(indexed),
                "split": split_name, "documents": [lo, hi], "seq_length": seq_length, "seed": seed, **key,
            }
            stem = os.path.join(cache_dir, f"{description_hash(self.description)}-GPTDataset-{split_name}")
            self._paths = {name: f"{stem}-{name}.npy" for name in _ARRAYS}
            build_once(lambda: is_cached(self._paths.values()),
                       lambda: _save_all(self._paths, build()))
            self._set_arrays({name: load_npy(path) for name, path in self._paths.items()})

    def _set_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        # Plain ndarray views: indexing an np.memmap subclass is several times slower per sample.
        self.document_index = arrays["document_index"].view(np.ndarray)
        self.sample_index = arrays["sample_index"].view(np.ndarray)
        self.shuffle_index = arrays["shuffle_index"].view(np.ndarray)

    # Workers re-map the cached files rather than receiving a pickled copy of the arrays.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._paths is not None:
            for name in _ARRAYS:
                del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._paths is not None:
            self._set_arrays({name: load_npy(path) for name, path in self._paths.items()})

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        n = len(self.shuffle_index)
        if not 0 <= idx < n:
            raise IndexError(f"sample {idx} out of range for {self.split_name} dataset of {n} samples")
        j = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[j:j + 2].tolist()
        doc, get = self.document_index, self.indexed.get
        if d0 == d1:
            return self._checked(get(int(doc[d0]), o0, o1 - o0 + 1).astype(np.int64), idx)
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        piece = get(int(doc[d0]), o0)
        pos = len(piece)
        out[:pos] = piece
        for d in range(d0 + 1, d1):
            piece = get(int(doc[d]))
            out[pos:pos + len(piece)] = piece
            pos += len(piece)
        out[pos:] = get(int(doc[d1]), 0, o1 + 1)
        return self._checked(out, idx)

    def _checked(self, sample: np.ndarray, idx: int) -> np.ndarray:
        # A max and a min over seq_length + 1 ids: negligible next to reading them.
        if self.vocab_size is not None and (sample.max() >= self.vocab_size or sample.min() < 0):
            bad = sorted({int(t) for t in sample if not 0 <= t < self.vocab_size})
            raise DataError(
                f"{bin_path(self.indexed.prefix)}: sample {idx} of the {self.split_name} split holds token ids "
                f"{bad[:5]} outside the tokenizer's vocabulary [0, {self.vocab_size}): the data was tokenized "
                "with another vocabulary, or the file is corrupt"
            )
        return sample


def corpus_fingerprint(corpus) -> dict:
    """What names a corpus in the cache key: its files' fingerprints, or the corpus's own (mock)."""
    if hasattr(corpus, "fingerprint"):
        return corpus.fingerprint()
    prefix = corpus.prefix
    return {"prefix": os.path.abspath(prefix), "idx": file_fingerprint(idx_path(prefix)),
            "bin": file_fingerprint(bin_path(prefix))}


def _save_all(paths: dict[str, str], arrays: dict[str, np.ndarray]) -> None:
    # Each file appears atomically under its name; the set counts as built once all three exist.
    for name in _ARRAYS:
        save_npy(paths[name], arrays[name])
