"""Distributed start-up and shut-down: the only place that reads torchrun's environment.

`python train.py` runs as one plain process (no process group, except a group of one for an
fp16/bf16 MoE model, whose compute FSDP casts); `torchrun` sets RANK and WORLD_SIZE, and then a process group is
created (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtgpt.faults import group_sockets
from dtgpt.faults.attempt_store import attempt_store
from dtgpt.config import Config, low_precision, validate
from dtgpt.config.devices import choose_device
from dtgpt.determinism import apply_determinism
from dtgpt.parallel import last_stage_rank, uses_compute_copy
from dtgpt.parallel.dims import ParallelDims
from dtgpt.parallel.rng import stage_seed
from dtgpt.parallel.serial_gloo import serial_gloo
from dtgpt.run.keys import LAUNCHER_ENV, replacement_number


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dims: ParallelDims
    restart_count: int = 0
    """How often torchrun has restarted the group (TORCHELASTIC_RESTART_COUNT); 0 on the first attempt."""
    store: dist.Store | None = None
    """This attempt's key-value store (dtgpt/faults/attempt_store.py); None without a process group."""
    launcher: str = ""
    """Who started this worker, when it says so (DTGPT_LAUNCHER): "dtgpt.run" replaces a dead worker alone."""
    replacement: int = 0
    """How often the launcher (`python -m dtgpt.run`) respawned this rank (DTGPT_REPLACEMENT); 0 for a
    rank of the start. A replacement takes its state from a replica twin (dtgpt/faults/recovery.py)."""
    logging_rank: int = 0
    """The rank that logs metrics: the last one holding the last pipeline stage, as Megatron logs
    from its last rank (under a V-shaped schedule pp rank 0 holds it; parallel.last_stage_rank)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.logging_rank


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(name: str, local_rank: int, local_ranks: int = 1) -> torch.device:
    """The device of this rank (dtgpt/config/devices.py: the rule); ConfigError before any
    process group where the node has fewer GPUs than local ranks."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choose_device(name, local_ranks, gpus) == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cfg: Config) -> Runtime:
    """Validate against the world size, start the process group if launched by torchrun, seed."""
    world_size = world_size_from_env()
    validate(cfg, world_size)  # before any process group: a config error costs no rendezvous
    dims = ParallelDims.from_config(cfg, world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.training.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    # NCCL and cuBLAS read their settings when first used: before the process group
    note = apply_determinism(device) if cfg.training.deterministic else None
    rank = 0
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = None
    if "RANK" in os.environ and not dist.is_initialized():
        store = init_process_group(cfg, device)
    elif low_precision(cfg) and not uses_compute_copy(cfg, dims) and not dist.is_initialized():
        init_one_rank_group(cfg, device)
    if dist.is_initialized():
        rank = dist.get_rank()
        dims.build_mesh(device.type)
    if note and rank == 0:
        print(note, flush=True)
    # Dropout differs between pipeline stages as in Megatron; weights and data order never
    # depend on this seed (they have their own, see GPT.init_weights and the data order).
    # The tp-region stream is seeded in build_model (dtgpt.parallel.rng).
    torch.manual_seed(stage_seed(cfg.training.seed, dims.pp_rank))
    launcher, replacement = os.environ.get(LAUNCHER_ENV, ""), replacement_number()
    return Runtime(
        rank, world_size, local_rank, device, dims, restart_count, store, launcher, replacement, last_stage_rank(cfg, world_size)
    )


def backend_for(cfg: Config, device: torch.device) -> str:
    """torch's backend name: NCCL, or gloo with one worker thread per group (dtgpt/parallel/serial_gloo.py: why)."""
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return serial_gloo() if backend == "gloo" and device.type == "cpu" else backend


def init_one_rank_group(cfg: Config, device: torch.device) -> None:
    """A process group of this process alone: an fp16/bf16 MoE model computes through FSDP's cast
    even at dp = 1 (dtgpt/parallel/fsdp.py; any other model through a compute copy,
    dtgpt/parallel/compute_copy.py), and FSDP needs a mesh, even of one rank (it then moves nothing)."""
    dist.init_process_group(
        backend=backend_for(cfg, device), store=dist.HashStore(), rank=0, world_size=1,
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip


def init_process_group(cfg: Config, device: torch.device, shared: dist.Store | None = None) -> dist.Store:
    """The default group, on a store of this attempt's own (dtgpt/faults/attempt_store.py: why); returns that store.
    `shared`: the job's store, when rebuilding the group in-process (dtgpt/faults/recovery.py)."""
    backend = backend_for(cfg, device)
    timeout = timedelta(minutes=cfg.distributed.timeout_minutes)
    group_sockets.install()  # what failure detection may shut: the groups' sockets, no other (detect.py)
    if shared is None:
        shared, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    else:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _token = attempt_store(shared, rank, world_size, timeout)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    return store


def shutdown(clean: bool = True, dims: ParallelDims | None = None) -> None:
    """Always destroy the process groups, and with `dims` let its meshes release them: gloo runs
    otherwise abort or crash at exit now and then (ParallelDims.release_groups says why).

    After an error (`clean=False`) there is no final barrier: a dead or stuck peer would hold
    this rank in it until the collective timeout, hiding the error that is on its way out.
    """
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
    if dims is not None:
        dims.release_groups()
