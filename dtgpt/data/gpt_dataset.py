"""GPT samples of seq_length + 1 tokens over an indexed dataset, with Megatron's GPTDataset semantics.

Three index arrays define the sample order:

- document index: the split's documents, each epoch shuffled on its own;
- sample index: row j = (position in the document index, token offset) where sample j starts;
  sample j covers stream tokens [j * seq_length, (j + 1) * seq_length], so neighbours share a token;
- shuffle index: the samples ending in epoch e, shuffled among themselves, epoch after epoch.

Epoch e draws from its own generator: epoch 0 from `numpy.random.RandomState(seed)`, documents
first and then samples, exactly as Megatron does for a one-epoch dataset. A later epoch never
changes an earlier one, so the order is a function of (data, document range, seq_length, seed)
alone: asking for more samples (a longer run) only appends epochs. Megatron instead shuffles all
epochs together, which makes its order depend on the number of samples asked for.

The arrays are cached as .npy files keyed by a hash of their inputs, built once by rank 0 and
memory-mapped.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import numpy as np

from dtgpt.data.cache import build_once, description_hash, file_fingerprint, load_npy, save_npy
from dtgpt.data.indexed import DataError, IndexedDataset, bin_path, idx_path

SPLIT_NAMES = ("train", "valid", "test")
_ARRAYS = ("document_index", "sample_index", "shuffle_index")


def parse_split(split: str) -> list[float]:
    """'949,50,1' -> [0.949, 0.05, 0.001]: up to three weights, missing ones 0, normalised."""
    parts = [p for p in re.split(r"[,/]", split) if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"data.split={split!r} must be comma-separated numbers like '949,50,1'") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.split={split!r} needs 1-3 non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def split_document_ranges(split: str, num_documents: int) -> list[Optional[tuple[int, int]]]:
    """Document range [lo, hi) of train/valid/test; None for a split of weight 0.

    Boundaries are round(cumulative fraction * num_documents), as in Megatron.
    """
    fractions = parse_split(split)
    bounds, total = [0.0], 0.0
    for f in fractions:
        total += f
        bounds.append(total)
    ranges: list[Optional[tuple[int, int]]] = []
    for f, lo, hi in zip(fractions, bounds[:-1], bounds[1:]):
        ranges.append(None if f <= 0 else (int(round(lo * num_documents)), int(round(hi * num_documents))))
    return ranges


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """Fewest epochs whose tokens cover num_samples samples plus the one extra token."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def epoch_seed(seed: int, epoch: int) -> int | list[int]:
    """Epoch 0: seed, Megatron's RandomState(seed). Epoch e > 0: [seed, e], an array seed, whose
    stream no integer seed produces (so seed + 1 never replays epoch 1)."""
    return seed if epoch == 0 else [seed, epoch]


def index_dtype(largest: int, small=np.int32, big=np.int64):
    """The smaller integer type when it holds `largest` (halves the cached index files)."""
    return small if largest < np.iinfo(small).max - 1 else big


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """(num_samples + 1, 2) array of (document index position, offset) where each sample starts.

    Vectorised: sample j starts at stream position j * seq_length; searchsorted over the cumulative
    document ends finds its document (skipping empty ones, as Megatron's loop does).
    """
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    num_samples = (total - 1) // seq_length
    if num_samples < 1:
        raise ValueError(f"{total} tokens cannot make one sample of seq_length + 1 = {seq_length + 1} tokens")
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    dtype = index_dtype(max(len(document_index), int(lengths.max())))
    return np.stack([position, offset], axis=1).astype(dtype)


def samples_ending_by_epoch(tokens_per_epoch: int, num_epochs: int, seq_length: int) -> list[int]:
    """Cumulative sample counts: entry e is the number of samples whose last token lies in
    epochs 0..e (sample j ends at stream position (j + 1) * seq_length)."""
    return [((e + 1) * tokens_per_epoch - 1) // seq_length for e in range(num_epochs)]


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_epochs: int, seq_length: int,
                      seed: int) -> dict[str, np.ndarray]:
    """document/sample/shuffle index over `num_epochs` epochs, each epoch shuffled on its own."""
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"documents [{documents[0] if len(documents) else 0}, ...) hold no tokens")
    doc_dtype = index_dtype(int(documents.max()) if len(documents) else 0)
    ends = samples_ending_by_epoch(tokens_per_epoch, num_epochs, seq_length)
    sample_dtype = index_dtype(ends[-1], np.uint32)
    epochs, blocks = [], []
    rng = np.random.RandomState()
    for e, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
        # Re-seeding one generator is ~10x cheaper than a new one; a small corpus may be
        # repeated for many thousands of epochs.
        rng.seed(epoch_seed(seed, e))
        order = np.asarray(documents, dtype=doc_dtype).copy()
        rng.shuffle(order)
        epochs.append(order)
        block = np.arange(lo, hi, dtype=sample_dtype)  # the block depends on token counts only
        rng.shuffle(block)  # drawn after the documents, from the same generator
        blocks.append(block)
    document_index = np.concatenate(epochs)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length)
    assert ends[-1] == len(sample_index) - 1
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": np.concatenate(blocks)}


class GPTDataset:
    """Samples of exactly seq_length + 1 tokens (int64) from documents [lo, hi) of an IndexedDataset.

    Enough epochs are built for `num_samples`; `len()` covers every sample of those epochs
    (>= num_samples, as in Megatron), and sample i is the same whatever num_samples was.
    With `cache_dir=None` the indices are built in memory and never written. With `vocab_size`,
    a sample holding an id outside [0, vocab_size) raises a DataError naming the file.
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int, seq_length: int,
                 seed: int, cache_dir: Optional[str], split_name: str = "train", vocab_size: Optional[int] = None):
        lo, hi = document_range
        if not 0 <= lo < hi <= len(indexed):
            raise ValueError(
                f"{indexed.prefix}: the {split_name} split has documents [{lo}, {hi}) of {len(indexed)}: "
                "no documents; use more data or a larger data.split weight"
            )
        if num_samples < 1 or seq_length < 1:
            raise ValueError(f"num_samples={num_samples} and seq_length={seq_length} must be >= 1")
        self.indexed, self.seq_length, self.split_name = indexed, seq_length, split_name
        self.vocab_size = vocab_size
        tokens_per_epoch = int(indexed.sequence_lengths[lo:hi].sum(dtype=np.int64))
        self.num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length) if tokens_per_epoch else 1
        self.description = {
            "class": "GPTDataset", "format": 2, "prefix": os.path.abspath(indexed.prefix),
            "idx": file_fingerprint(idx_path(indexed.prefix)), "bin": file_fingerprint(bin_path(indexed.prefix)),
            "split": split_name, "documents": [lo, hi], "num_epochs": self.num_epochs,
            "seq_length": seq_length, "seed": seed,
        }

        def build() -> dict[str, np.ndarray]:
            docs = np.arange(lo, hi, dtype=np.int64)
            return build_gpt_indices(indexed.sequence_lengths, docs, self.num_epochs, seq_length, seed)

        self._paths = None
        if cache_dir is None:
            self._set_arrays(build())
        else:
            stem = os.path.join(cache_dir, f"{description_hash(self.description)}-GPTDataset-{split_name}")
            self._paths = {name: f"{stem}-{name}.npy" for name in _ARRAYS}
            build_once(lambda: all(os.path.isfile(p) for p in self._paths.values()),
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


def _save_all(paths: dict[str, str], arrays: dict[str, np.ndarray]) -> None:
    # Each file appears atomically under its name; the set counts as built once all three exist.
    for name in _ARRAYS:
        save_npy(paths[name], arrays[name])
