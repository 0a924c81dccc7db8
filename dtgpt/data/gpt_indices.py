"""The three index arrays that order a GPT dataset's samples, in Megatron's order or the stable one.

- document index: the split's documents, repeated for each epoch and shuffled;
- sample index: row j = (position in the document index, token offset) where sample j starts;
  sample j covers stream tokens [j * seq_length, (j + 1) * seq_length], so neighbours share a token;
- shuffle index: a permutation of the samples.

`order="megatron"` is Megatron's GPTDataset draw for draw: one `RandomState(seed)` shuffles the
documents of all epochs together, then all samples together; a final epoch used for less than
80 % is shuffled apart (documents and samples), so that its few samples are not spread over the
whole run. The order therefore depends on the number of samples asked for.

`order="stable"` shuffles epoch by epoch, epoch e from its own generator (epoch 0 from
`RandomState(seed)`, as Megatron's one-epoch case): asking for more samples only appends epochs.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

ORDERS = ("megatron", "stable")
FINAL_EPOCH_THRESHOLD = 0.80
"""Megatron shuffles the final epoch apart when it supplies fewer than this share of an epoch's samples."""


def index_dtype(largest: int, small=np.int32, big=np.int64):
    """The smaller integer type when it holds `largest` (halves the cached index files)."""
    return small if largest < np.iinfo(small).max - 1 else big


def num_epochs_needed(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int) -> int:
    """Fewest epochs whose tokens cover num_samples samples plus the one extra token (None: one epoch)."""
    if num_samples is None:
        return 1
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, num_epochs: int, num_samples: Optional[int], seq_length: int) -> bool:
    """Megatron's rule: with several epochs, is the last one used for less than 80 % of its samples?"""
    if num_epochs == 1 or num_samples is None:
        return False
    from_final = num_samples - samples_before_final_epoch(tokens_per_epoch, num_epochs, seq_length)
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return from_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)


def samples_before_final_epoch(tokens_per_epoch: int, num_epochs: int, seq_length: int) -> int:
    return ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """(num_samples + 1, 2) array of (document index position, offset) where each sample starts.

    Sample j starts at stream position j * seq_length, so before[d] = ceil(end_d / seq_length)
    samples start before document d ends, and sample j lies in the first document with
    before[d] > j: the number of documents with before[d] <= j, a histogram of `before` summed
    up. Empty documents are skipped as Megatron's C++ loop (the reference) skips them. A few
    linear passes, no search.
    """
    lengths = np.take(np.asarray(sequence_lengths), document_index)
    total = int(lengths.sum(dtype=np.int64))
    num_samples = (total - 1) // seq_length
    if num_samples < 1:
        raise ValueError(f"{total} tokens cannot make one sample of seq_length + 1 = {seq_length + 1} tokens")
    # Token positions in int32 whenever they fit: half the memory traffic of every pass below.
    position_dtype = np.int32 if total + seq_length < np.iinfo(np.int32).max else np.int64
    ends = np.cumsum(lengths, dtype=position_dtype)
    before = ends + (seq_length - 1)
    if seq_length & (seq_length - 1) == 0:  # the usual power of two: a shift, not a division
        np.right_shift(before, seq_length.bit_length() - 1, out=before)
    else:
        np.floor_divide(before, seq_length, out=before)
    # No sequence is longer than all tokens together: the total bounds the largest entry.
    largest = max(len(document_index), total if position_dtype is np.int32 else int(lengths.max()))
    dtype = index_dtype(largest)
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    position = np.cumsum(np.bincount(before, minlength=num_samples + 2)[:num_samples + 1], dtype=dtype)
    position[0] = 0  # Megatron's first row is (0, 0) even when the stream opens with empty documents
    out[:, 0] = position
    # offset = sample start - document start = j * seq_length - (end - length)
    offset = np.arange(0, (num_samples + 1) * seq_length, seq_length, dtype=position_dtype)
    offset -= ends[position]
    offset += lengths[position]
    out[:, 1] = offset
    return out


def _shuffled(values: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    rng.shuffle(values)
    return values


def _shuffle_dtype(total: int):
    return np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64


def megatron_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: Optional[int],
                     seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """Megatron's GPTDataset indices for `num_samples` samples (None: one epoch)."""
    tokens_per_epoch = _tokens(sequence_lengths, documents)
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    apart = separate_final_epoch(tokens_per_epoch, num_epochs, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    docs = np.asarray(documents, dtype=np.int32)
    together = num_epochs - 1 if apart else num_epochs
    document_index = _shuffled(np.tile(docs, together), rng)
    if apart:
        document_index = np.concatenate([document_index, _shuffled(docs.copy(), rng)])
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length)
    total = len(sample_index) - 1
    first = samples_before_final_epoch(tokens_per_epoch, num_epochs, seq_length) if apart else total
    dtype = _shuffle_dtype(total)
    shuffle_index = _shuffled(np.arange(first, dtype=dtype), rng)
    if apart:
        shuffle_index = np.concatenate([shuffle_index, _shuffled(np.arange(first, total, dtype=dtype), rng)])
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def stable_epoch_seed(seed: int, epoch: int) -> int | list[int]:
    """Epoch 0: seed, Megatron's RandomState(seed). Epoch e > 0: [seed, e], an array seed, whose
    stream no integer seed produces (so seed + 1 never replays epoch 1)."""
    return seed if epoch == 0 else [seed, epoch]


def samples_ending_by_epoch(tokens_per_epoch: int, num_epochs: int, seq_length: int) -> list[int]:
    """Cumulative sample counts: entry e is the number of samples whose last token lies in
    epochs 0..e (sample j ends at stream position (j + 1) * seq_length)."""
    return [((e + 1) * tokens_per_epoch - 1) // seq_length for e in range(num_epochs)]


def stable_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: Optional[int],
                   seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """The stable order: each epoch's documents, then the samples ending in it, shuffled on their own."""
    tokens_per_epoch = _tokens(sequence_lengths, documents)
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    doc_dtype = index_dtype(int(documents.max()) if len(documents) else 0)
    ends = samples_ending_by_epoch(tokens_per_epoch, num_epochs, seq_length)
    sample_dtype = index_dtype(ends[-1], np.uint32)
    epochs, blocks = [], []
    rng = np.random.RandomState()
    for e, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
        # Re-seeding one generator is ~10x cheaper than a new one; a small corpus may be
        # repeated for many thousands of epochs.
        rng.seed(stable_epoch_seed(seed, e))
        epochs.append(_shuffled(np.asarray(documents, dtype=doc_dtype).copy(), rng))
        blocks.append(_shuffled(np.arange(lo, hi, dtype=sample_dtype), rng))  # after the documents
    document_index = np.concatenate(epochs)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length)
    assert ends[-1] == len(sample_index) - 1
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": np.concatenate(blocks)}


def _tokens(sequence_lengths: np.ndarray, documents: np.ndarray) -> int:
    tokens = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if tokens == 0:
        raise ValueError(f"documents [{documents[0] if len(documents) else 0}, ...) hold no tokens")
    return tokens


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: Optional[int],
                      seq_length: int, seed: int, order: str = "megatron") -> dict[str, np.ndarray]:
    """document/sample/shuffle index for `num_samples` samples of `documents`, in `order`."""
    build = {"megatron": megatron_indices, "stable": stable_indices}[order]
    return build(sequence_lengths, documents, num_samples, seq_length, seed)


def cache_key(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int, order: str) -> dict:
    """What the arrays depend on besides the data, the documents, seq_length and seed."""
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    key = {"order": order, "num_epochs": num_epochs}
    if order == "megatron":
        key["separate_final_epoch"] = separate_final_epoch(tokens_per_epoch, num_epochs, num_samples, seq_length)
    return key
