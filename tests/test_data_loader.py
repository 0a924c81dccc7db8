"""The loader: global batch k is the same samples on any mesh; resuming on another DP size."""

import numpy as np
import pytest
import torch

from dtgpt.data.loader import build_data_loader
from dtgpt.data.loader import GlobalBatchSampler

SEQ = 8


class Numbered:
    """Sample i is [i, i, ..., i]: batches show exactly which samples they hold."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return np.full(SEQ + 1, i, dtype=np.int64)


def ramp(consumed):
    """Batch-size ramp-up: 4 for the first 16 samples, then 8, then 12 from 48 on."""
    return 4 if consumed < 16 else 8 if consumed < 48 else 12


def global_stream(dataset, consumed, batch_size_at, dp_size, num_batches, num_workers=0):
    """Global batches rebuilt by concatenating every rank's slice, as an all-gather would."""
    loaders = [iter(build_data_loader(dataset, consumed, batch_size_at, r, dp_size, num_workers)) for r in range(dp_size)]
    out = []
    for _ in range(num_batches):
        parts = [next(it) for it in loaders]
        for p in parts:
            assert p.dtype == torch.int64 and p.shape[1] == SEQ + 1
            assert p.shape[0] * dp_size == batch_size_at(consumed)
        batch = torch.cat(parts)
        out.append(batch[:, 0].tolist())
        consumed += len(batch)
    return out


def test_global_batches_are_consecutive_samples():
    batches = global_stream(Numbered(200), 0, ramp, dp_size=2, num_batches=8)
    flat = [i for b in batches for i in b]
    assert flat == list(range(len(flat)))
    assert [len(b) for b in batches] == [4, 4, 4, 4, 8, 8, 8, 8]


def test_rank_takes_a_contiguous_slice():
    sampler = GlobalBatchSampler(100, 16, lambda c: 8, dp_rank=1, dp_size=4)
    assert next(iter(sampler)) == [18, 19]


def test_resume_on_another_dp_size_gives_the_same_stream():
    data = Numbered(400)
    uninterrupted = global_stream(data, 0, ramp, dp_size=2, num_batches=12)
    first = global_stream(data, 0, ramp, dp_size=2, num_batches=5)
    consumed = sum(len(b) for b in first)
    resumed = global_stream(data, consumed, ramp, dp_size=4, num_batches=7)
    assert first + resumed == uninterrupted
    assert global_stream(data, consumed, ramp, dp_size=1, num_batches=7) == resumed


def test_workers_give_the_same_batches():
    data = Numbered(120)
    assert global_stream(data, 8, ramp, 2, 6, num_workers=2) == global_stream(data, 8, ramp, 2, 6)


def test_stops_when_the_dataset_is_exhausted():
    loader = build_data_loader(Numbered(30), 0, lambda c: 8, 0, 2, 0)
    batches = list(loader)
    assert len(batches) == 3 and len(loader) == 3  # 24 samples; the 4 left cannot fill a batch
    assert list(build_data_loader(Numbered(30), 24, lambda c: 8, 0, 2, 0)) == []


def test_bad_batch_size_or_rank_is_an_error():
    with pytest.raises(ValueError, match="global batch size 0 at consumed_samples=0 must be positive"):
        next(iter(build_data_loader(Numbered(30), 0, lambda c: 0, 0, 4, 0)))
    with pytest.raises(ValueError, match="dp_rank=4"):
        build_data_loader(Numbered(30), 0, lambda c: 8, 4, 4, 0)


def test_starting_a_loader_leaves_the_global_rng_alone():
    """Dropout draws from the global RNG: evaluation loaders must not shift it."""
    import torch

    from dtgpt.data.loader import build_data_loader

    dataset = [np.arange(5, dtype=np.int64) + i for i in range(16)]
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    next(iter(build_data_loader(dataset, 0, lambda consumed: 4, 0, 1, 0)))
    assert torch.equal(torch.rand(3), expected)
