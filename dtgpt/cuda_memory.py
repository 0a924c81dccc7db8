"""The CUDA caching allocator's history, behind one door: torch.cuda.memory's private
`_record_memory_history` and `_dump_snapshot` (checked on torch 2.11 and 2.13; tests/
test_torch_cuda_apis.py fails when a torch lacks them). CUDA only: callers ask on_cuda first."""

from __future__ import annotations

import os

import torch

MAX_ENTRIES = 100_000
"""Allocation and free events kept (the oldest are dropped): bounded memory, as Megatron's."""


def start_recording() -> None:
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def stop_recording() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)  # recording costs time on every allocation


def dump_snapshot(path: str) -> None:
    """The history so far as a pickle that pytorch.org/memory_viz opens."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)
