"""Mock data: a function of (seed, split, index) only, in range, and made of predictable documents."""

import numpy as np
import pytest

from dtgpt.data.mock import MockGPTDataset


def documents(sample, eod):
    """The complete documents of a sample: the runs strictly between two eods."""
    cuts = np.flatnonzero(sample == eod)
    return [sample[a + 1:b] for a, b in zip(cuts[:-1], cuts[1:])]


def is_predictable(doc, eod, alphabet):
    s = doc - (doc > eod)  # undo the shift around eod
    steps = np.diff(s) % alphabet
    counting = len(set(steps.tolist())) == 1 and steps[0] in (1, 2, 3)
    repeating = any(np.array_equal(s[p:], s[:-p]) for p in range(2, 7))
    return counting or repeating


@pytest.mark.parametrize("vocab,eod", [(1000, 999), (100, 50), (257, 256)])
def test_mock_samples(vocab, eod):
    ds = MockGPTDataset(50, 128, vocab, eod, seed=3)
    alphabet = min(256, vocab - 1)
    n_docs = 0
    for i in range(len(ds)):
        x = ds[i]
        assert x.dtype == np.int64 and x.shape == (129,)
        assert x.min() >= 0 and x.max() < vocab
        for doc in documents(x, eod):
            assert len(doc) >= 8 and is_predictable(doc, eod, alphabet), doc
            n_docs += 1
    assert n_docs > 50  # several documents per sample, separated by eod


def test_mock_is_a_function_of_seed_split_and_index():
    a = MockGPTDataset(20, 64, 1000, 999, seed=1)
    b = MockGPTDataset(5000, 64, 1000, 999, seed=1)  # a different length changes nothing
    assert all(np.array_equal(a[i], b[i]) for i in range(20))
    assert not np.array_equal(a[0], a[1])
    assert not np.array_equal(a[0], MockGPTDataset(20, 64, 1000, 999, seed=2)[0])
    assert not np.array_equal(a[0], MockGPTDataset(20, 64, 1000, 999, seed=1, split_name="valid")[0])
    # a longer sequence extends the same token stream
    assert np.array_equal(MockGPTDataset(2, 256, 1000, 999, seed=1)[0][:65], a[0])
    with pytest.raises(IndexError):
        a[20]
