"""Mock data as Megatron Core's MockGPTDataset, sample for sample: no files needed.

Megatron's mock "corpus" (its MockGPTLowLevelDataset) holds 100,000 documents whose lengths are
drawn once from `numpy.random.default_rng(0)` in [1, 4096); document d of length n is the ids
1, 2, ..., n - 1 modulo the vocabulary, then the eod. Its MockGPTDataset is a GPTDataset over
that corpus: the split's documents, shuffled and cut into samples with the training seed exactly
as real data is (dtgpt.data.gpt_dataset), so Megatron Core's own simple loop and dtgpt train on
the same mock tokens. The ids count up, so a tiny model learns them fast.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from dtgpt.config.split import split_document_ranges
from dtgpt.data.gpt_dataset import GPTDataset

DOCUMENTS = 100_000
MAX_LENGTH = 4096
LENGTH_SEED = 0
"""Megatron's hard-coded corpus: this many documents, lengths in [1, MAX_LENGTH), drawn with this seed."""
MOCK_SPLIT = "1,1,1"
"""Megatron splits its mock documents evenly whatever --split says (its config overrides it)."""


class MockDocuments:
    """Megatron's mock corpus behind the IndexedDataset interface GPTDataset reads."""

    prefix = "<mock>"

    def __init__(self, vocab_size: int, eod: int):
        if vocab_size < 2 or not 0 <= eod < vocab_size:
            raise ValueError(f"mock data needs vocab_size >= 2 and 0 <= eod < vocab_size, got {vocab_size}, {eod}")
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(seed=LENGTH_SEED)
        self.sequence_lengths = rng.integers(low=1, high=MAX_LENGTH, size=DOCUMENTS, dtype=np.int32)

    def __len__(self) -> int:
        return DOCUMENTS

    def fingerprint(self) -> dict:
        """The index arrays depend on the document lengths only, which are fixed."""
        return {"prefix": self.prefix, "documents": DOCUMENTS, "max_length": MAX_LENGTH, "length_seed": LENGTH_SEED}

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document idx (to its end when length is None)."""
        n = int(self.sequence_lengths[idx])
        if length is None:
            length = n - offset
        position = np.arange(offset, min(offset + length, n), dtype=np.int64)
        return np.where(position == n - 1, self.eod, (position + 1) % self.vocab_size)


def build_mock_dataset(split_index: int, num_samples: int, seq_length: int, vocab_size: int, eod: int, seed: int,
                       split_name: str, cache_dir: Optional[str]) -> GPTDataset:
    """Megatron's MockGPTDataset for one split (of the 100,000 mock documents, split MOCK_SPLIT).

    Its index arrays are cached like real data's (`cache_dir`; None: built in memory): ordering
    a 200M-token epoch takes seconds, which every run and rank would otherwise pay.
    """
    corpus = MockDocuments(vocab_size, eod)
    document_range = split_document_ranges(MOCK_SPLIT, len(corpus))[split_index]
    return GPTDataset(corpus, document_range, num_samples, seq_length, seed, cache_dir, split_name)
