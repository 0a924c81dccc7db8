"""Gloo with one worker thread per process group: a group's collectives run one at a time, in
the order they were issued, while the training thread goes on (async collectives stay async).

torch builds a gloo group with two worker threads, so two async collectives of one group run at
once over the same connections: FSDP's reduce-scatter (gloo's ring all-reduce) beside the next
unit's all-gather, say. Under load that fails now and then inside gloo's TCP transport: a
deadlock (no collective timeout fires), or corrupted memory (a crash in a later collective's
wait). `scripts/gloo_stress.py` reproduces both with plain torch, and runs clean on one thread
(docs/faults.md, Known limits, has the figures). Groups still run side by side with each other:
each has its own connections and thread.

Registered with torch as its own backend (torch offers no other way to set a gloo group's thread
count); dtgpt uses it wherever the config says gloo on CPU (dtgpt/distributed.py)."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

NAME = "serial_gloo"


def _devices() -> list:
    """The network devices torch's own gloo would use: one per GLOO_SOCKET_IFNAME interface, or the default."""
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if interfaces:
        return [ProcessGroupGloo.create_device(interface=name) for name in interfaces]
    return [ProcessGroupGloo.create_default_device()]


def _create(store: dist.Store, rank: int, size: int, timeout) -> ProcessGroupGloo:
    options = ProcessGroupGloo._Options()
    options._devices = _devices()
    options._threads = 1
    options._timeout = timeout
    return ProcessGroupGloo(store, rank, size, options)


def serial_gloo() -> str:
    """The backend name to pass to torch for a gloo group of one worker thread (registered once per process)."""
    if not hasattr(dist.Backend, NAME.upper()):
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    return NAME
