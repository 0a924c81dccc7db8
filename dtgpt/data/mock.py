"""Synthetic GPT samples that need no files: sample i is a function of (seed, split, i) only.

Each sample is a run of short documents separated by eod. A document either counts
(a, a+s, a+2s, ... over a small alphabet) or repeats a short random motif, so after a few
tokens the rest is predictable: a tiny model's loss falls well below log(vocab) within a few
hundred steps, which makes mock data useful for checking that training learns at all.
"""

from __future__ import annotations

import numpy as np

from dtgpt.config.split import SPLIT_NAMES

ALPHABET = 256
"""Tokens are drawn from the first min(256, vocab_size - 1) non-eod ids: frequent enough to learn fast."""
_DOC_LENGTHS = (8, 65)
_COUNT_STEPS = (1, 4)
_MOTIF_LENGTHS = (2, 7)


class MockGPTDataset:
    """`num_samples` samples of seq_length + 1 int64 tokens in [0, vocab_size)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, eod: int, seed: int,
                 split_name: str = "train"):
        if vocab_size < 2 or not 0 <= eod < vocab_size:
            raise ValueError(f"mock data needs vocab_size >= 2 and 0 <= eod < vocab_size, got {vocab_size}, {eod}")
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.eod = vocab_size, eod
        self.split_name = split_name
        # SeedSequence takes non-negative entropy; the split keeps train/valid/test streams apart.
        self._entropy = [int(seed) & (2**64 - 1), SPLIT_NAMES.index(split_name)]
        self._alphabet = min(ALPHABET, vocab_size - 1)

    def __len__(self) -> int:
        return self.num_samples

    def _document(self, rng: np.random.Generator) -> np.ndarray:
        k = self._alphabet
        length = int(rng.integers(*_DOC_LENGTHS))
        if rng.integers(2) == 0:
            start, step = rng.integers(k), rng.integers(*_COUNT_STEPS)
            symbols = (start + step * np.arange(length)) % k
        else:
            motif = rng.integers(0, k, int(rng.integers(*_MOTIF_LENGTHS)))
            symbols = np.resize(motif, length)
        # Shift symbols at or above eod up by one so that eod only ever ends a document.
        return symbols + (symbols >= self.eod)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for mock {self.split_name} dataset of {self.num_samples}")
        rng = np.random.default_rng([*self._entropy, int(idx)])
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        pos = 0
        while pos < len(out):
            doc = self._document(rng)
            take = min(len(doc), len(out) - pos)
            out[pos:pos + take] = doc[:take]
            pos += take
            if pos < len(out):
                out[pos] = self.eod
                pos += 1
        return out
