"""GPTDataset: indices against plain-Python references, both orders' epochs, splits, the .npy cache.

Megatron's order itself is checked against megatron-core in test_data_megatron_oracle.py."""

import os
import pickle

import numpy as np
import pytest

from dtgpt.config.split import parse_split, split_document_ranges
from dtgpt.data.gpt_dataset import GPTDataset
from dtgpt.data.gpt_indices import build_sample_index, num_epochs_needed
from dtgpt.data.indexed import IndexedDataset, IndexedDatasetWriter

SEED = 1234


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    rng = np.random.default_rng(7)
    prefix = tmp_path_factory.mktemp("gpt") / "docs"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(60):
            n = 0 if i % 13 == 5 else int(rng.integers(1, 40))  # a few empty documents too
            w.add_document(rng.integers(0, 1000, n))
    return IndexedDataset(prefix)


def reference_sample_index(sizes, doc_index, seq_length):
    """Megatron's sample walk, one token budget at a time, in plain Python."""
    total = sum(int(sizes[d]) for d in doc_index)
    rows, pos, off = [(0, 0)], 0, 0
    for _ in range((total - 1) // seq_length):
        remaining = seq_length + 1
        while True:
            available = int(sizes[doc_index[pos]]) - off
            if remaining <= available:
                off += remaining - 1  # the last token is shared with the next sample
                break
            remaining -= available
            pos, off = pos + 1, 0
        rows.append((pos, off))
    return rows


def token_stream(ds, doc_index):
    return [int(t) for d in doc_index for t in ds[int(d)]]


@pytest.mark.parametrize("seq_length", [1, 7, 16, 50])
def test_sample_index_matches_reference(indexed, seq_length):
    rng = np.random.RandomState(0)
    doc_index = np.tile(np.arange(60), 2)
    rng.shuffle(doc_index)
    got = build_sample_index(indexed.sequence_lengths, doc_index, seq_length)
    assert [tuple(r) for r in got.tolist()] == reference_sample_index(indexed.sequence_lengths, doc_index, seq_length)


@pytest.mark.parametrize("order", ["megatron", "stable"])
@pytest.mark.parametrize("num_samples,seq_length", [(20, 16), (200, 16), (90, 31)])
def test_samples_are_the_shuffled_token_stream(indexed, num_samples, seq_length, order):
    lo, hi = 3, 55
    ds = GPTDataset(indexed, (lo, hi), num_samples, seq_length, SEED, cache_dir=None, order=order)
    tokens_per_epoch = int(indexed.sequence_lengths[lo:hi].sum())
    epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    assert epochs * tokens_per_epoch >= num_samples * seq_length + 1 > (epochs - 1) * tokens_per_epoch
    assert ds.num_epochs == epochs and len(ds) >= num_samples
    assert len(ds) == (epochs * tokens_per_epoch - 1) // seq_length
    assert sorted(ds.document_index.tolist()) == sorted(list(range(lo, hi)) * epochs)
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    stream = token_stream(indexed, ds.document_index)
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        assert sample.tolist() == stream[j * seq_length: j * seq_length + seq_length + 1]
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.parametrize("order", ["megatron", "stable"])
def test_one_epoch_is_megatrons_in_both_orders(indexed, order):
    # one epoch: documents shuffled first, then the samples, from one RandomState(seed)
    ds = GPTDataset(indexed, (0, 60), 30, 16, SEED, cache_dir=None, order=order)
    rng = np.random.RandomState(SEED)
    docs = np.arange(60, dtype=np.int32)
    rng.shuffle(docs)
    shuffle = np.arange(len(ds), dtype=np.uint32)
    rng.shuffle(shuffle)
    assert ds.num_epochs == 1
    np.testing.assert_array_equal(ds.document_index, docs)
    np.testing.assert_array_equal(ds.shuffle_index, shuffle)


def test_stable_order_shuffles_each_epoch_with_its_own_generator(indexed):
    tokens = int(indexed.sequence_lengths.sum())
    seq = 8
    num_samples = (2 * tokens - 1) // seq + 3  # two full epochs plus a few samples: three epochs
    ds = GPTDataset(indexed, (0, 60), num_samples, seq, SEED, cache_dir=None, order="stable")
    assert ds.num_epochs == 3
    ends = [0] + [((e + 1) * tokens - 1) // seq for e in range(3)]
    for e in range(3):
        rng = np.random.RandomState(SEED) if e == 0 else np.random.RandomState([SEED, e])
        docs = np.arange(60, dtype=np.int32)
        rng.shuffle(docs)
        samples = np.arange(ends[e], ends[e + 1], dtype=np.uint32)
        rng.shuffle(samples)  # the samples whose last token lies in epoch e, after its documents
        np.testing.assert_array_equal(ds.document_index[60 * e: 60 * (e + 1)], docs)
        np.testing.assert_array_equal(ds.shuffle_index[ends[e]: ends[e + 1]], samples)
    assert len(ds) == ends[-1]


@pytest.mark.parametrize("seq_length", [8, 16])
def test_stable_order_does_not_depend_on_the_number_of_samples(indexed, seq_length):
    """Invariant 2, opt-in: asking for more samples (a longer run, resumed) only appends epochs."""
    datasets = [GPTDataset(indexed, (2, 58), n, seq_length, SEED, cache_dir=None, order="stable")
                for n in (5, 150, 400, 401)]
    assert [d.num_epochs for d in datasets][0] == 1 and datasets[-1].num_epochs > datasets[1].num_epochs > 1
    longest = datasets[-1]
    for ds in datasets[:-1]:
        assert all(np.array_equal(ds[i], longest[i]) for i in range(len(ds)))


def test_megatron_order_depends_on_the_number_of_samples(indexed):
    """The trade-off of the default: Megatron shuffles all epochs together, so a longer request
    reorders from sample 0 (this is what the stable order avoids)."""
    one, three = (GPTDataset(indexed, (0, 60), n, 8, SEED, cache_dir=None) for n in (5, 300))
    assert three.num_epochs > 1
    assert not all(np.array_equal(one[i], three[i]) for i in range(len(one)))


def test_megatron_final_epoch_apart_below_80_percent(indexed):
    """A final epoch used for < 80 % is shuffled on its own: documents after those of the other
    epochs, samples after theirs."""
    tokens, seq = int(indexed.sequence_lengths.sum()), 8
    per_epoch = (tokens - 1) // seq
    apart = GPTDataset(indexed, (0, 60), per_epoch + per_epoch // 4, seq, SEED, cache_dir=None)
    together = GPTDataset(indexed, (0, 60), per_epoch + 9 * per_epoch // 10, seq, SEED, cache_dir=None)
    assert apart.num_epochs == together.num_epochs == 2
    first = (tokens - 1) // seq  # samples ending before the final epoch
    assert sorted(apart.document_index[60:].tolist()) == list(range(60))
    assert sorted(apart.shuffle_index[:first].tolist()) == list(range(first))
    assert sorted(together.document_index[60:].tolist()) != list(range(60))  # epochs mixed


def test_split_boundaries():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_document_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_document_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    assert split_document_ranges("969,30,1", 100) == [(0, 97), (97, 100), (100, 100)]
    assert split_document_ranges("100,0,0", 7) == [(0, 7), None, None]
    assert split_document_ranges("2/1", 9) == [(0, 6), (6, 9), None]
    for bad in ("", "a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match=rf"data.split={bad!r} must be 1-3 non-negative numbers"):
            parse_split(bad)


def test_empty_split_range_is_a_clear_error(indexed):
    with pytest.raises(ValueError, match=r"valid split has documents \[5, 5\).*no documents"):
        GPTDataset(indexed, (5, 5), 10, 8, SEED, cache_dir=None, split_name="valid")


def arrays(cache: str) -> list[str]:
    """The cached .npy arrays (each has a .crc32 beside it)."""
    return sorted(f for f in os.listdir(cache) if f.endswith(".npy"))


def test_cache_built_once_keyed_by_inputs(indexed, tmp_path, monkeypatch):
    import dtgpt.data.gpt_dataset as gd

    calls = []
    real = gd.build_gpt_indices
    monkeypatch.setattr(gd, "build_gpt_indices", lambda *a: calls.append(a) or real(*a))
    cache = str(tmp_path / "cache")
    a = GPTDataset(indexed, (0, 50), 40, 16, SEED, cache)
    b = GPTDataset(indexed, (0, 50), 40, 16, SEED, cache)
    assert len(calls) == 1 and len(arrays(cache)) == 3
    assert isinstance(np.load(os.path.join(cache, arrays(cache)[0]), mmap_mode="r"), np.memmap)
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    GPTDataset(indexed, (0, 50), 40, 16, SEED + 1, cache)
    GPTDataset(indexed, (0, 50), 40, 8, SEED, cache)
    GPTDataset(indexed, (0, 49), 40, 16, SEED, cache)
    assert len(calls) == 4 and len(arrays(cache)) == 12
    GPTDataset(indexed, (0, 50), 41, 16, SEED, cache)  # same epochs, same arrays: no rebuild
    assert len(calls) == 4
    more = GPTDataset(indexed, (0, 50), 4 * len(a), 16, SEED, cache)
    assert len(calls) == 5 and len(arrays(cache)) == 15 and more.num_epochs > a.num_epochs
    GPTDataset(indexed, (0, 50), 40, 16, SEED, cache, order="stable")  # the other order: its own arrays
    assert len(calls) == 6 and len(arrays(cache)) == 18
    # same inputs in a fresh cache: the same samples (order depends on the data and settings only)
    c = GPTDataset(indexed, (0, 50), 40, 16, SEED, str(tmp_path / "other"))
    assert all(np.array_equal(a[i], c[i]) for i in range(len(a)))


def test_pickles_without_copying_arrays(indexed, tmp_path):
    ds = GPTDataset(indexed, (0, 60), 25, 16, SEED, str(tmp_path))
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert all(np.array_equal(ds[i], clone[i]) for i in range(len(ds)))
