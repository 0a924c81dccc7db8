"""Global batch k -> this data-parallel rank's share, through torch's DataLoader.

Global batch k is samples [consumed, consumed + gbs_k) of the dataset's global order, whatever
the mesh; DP rank r takes the contiguous slice [consumed + r * gbs_k / dp, ... + gbs_k / dp).
Resuming only needs `consumed_samples`, so a run may resume on another DP size (or micro-batch
size: splitting a rank's share into micro-batches is the training loop's business). That is
why the loader's own position is never checkpointed (docs/data.md, "Loader").
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from dtgpt.data.batch import Batch, TokenOptions, build_batch


class GlobalBatchSampler:
    """Yields, per global batch, the dataset indices of this DP rank's slice.

    `batch_size_at(consumed_samples)` gives the global batch size starting at that many samples
    (batch-size ramp-up). Iteration stops before a global batch that the dataset cannot fill.
    """

    def __init__(self, total_samples: int, consumed_samples: int, batch_size_at: Callable[[int], int],
                 dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must be >= 0")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.batch_size_at, self.dp_rank, self.dp_size = batch_size_at, dp_rank, dp_size

    def _batches(self) -> Iterator[tuple[int, int]]:
        """(start, global batch size) of each global batch from consumed_samples on."""
        consumed = self.consumed_samples
        while True:
            gbs = int(self.batch_size_at(consumed))
            if gbs <= 0:  # would never advance; divisibility by dp is validation's (config/derived.py)
                raise ValueError(f"global batch size {gbs} at consumed_samples={consumed} must be positive")
            if consumed + gbs > self.total_samples:
                return
            yield consumed, gbs
            consumed += gbs

    def __iter__(self) -> Iterator[list[int]]:
        for start, gbs in self._batches():
            share = gbs // self.dp_size
            first = start + self.dp_rank * share
            yield list(range(first, first + share))

    def __len__(self) -> int:
        return sum(1 for _ in self._batches())


def collate_samples(samples: list[np.ndarray]) -> torch.Tensor:
    """Stack int64 samples into a (batch, seq_length + 1) LongTensor."""
    return torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))


def collate_batch(samples: list[np.ndarray], options: TokenOptions) -> Batch:
    """Stacked samples as the Batch the model trains on (labels, positions, documents)."""
    return build_batch(collate_samples(samples), options)


def build_data_loader(dataset, consumed_samples: int, batch_size_at: Callable[[int], int], dp_rank: int,
                      dp_size: int, num_workers: int, options: Optional[TokenOptions] = None) -> DataLoader:
    """Iterable of this rank's (gbs_k / dp_size, seq_length + 1) LongTensors, from consumed_samples on;
    with `options`, of Batches built from them (dtgpt.data.batch).

    With num_workers > 0, worker processes read and prefetch batches ahead of the training loop.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0")
    sampler = GlobalBatchSampler(len(dataset), consumed_samples, batch_size_at, dp_rank, dp_size)
    extra = {"prefetch_factor": 2, "persistent_workers": False} if num_workers > 0 else {}
    collate = collate_samples if options is None else partial(collate_batch, options=options)
    # A private generator: starting an iterator draws a base seed, and drawing it from the
    # global RNG would shift dropout masks after every evaluation (resume would not be exact).
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate,
                      pin_memory=torch.cuda.is_available(), generator=torch.Generator().manual_seed(0), **extra)
