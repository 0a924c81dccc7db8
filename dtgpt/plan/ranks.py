"""Build each rank of a layout on the meta device, for the planner.

Each (pp rank, tp rank) is built under PyTorch's "fake" process group at the job's full world
size through `build_meta_parts()` -> `parallelize()`, the path training takes, and its parameters
are counted as the real sharded DTensors hold them. Ranks whose stages hold the same kind of
parts are built once.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from dtgpt.chunks import rows_of
from dtgpt.config import Config
from dtgpt.model import GPT
from dtgpt.muon import is_muon_matrix
from dtgpt.parallel import ParallelDims, build_meta_parts
from dtgpt.parallel.pipeline import stage_ids_on_rank, stage_layer_counts
from dtgpt.parallel.recompute import block_recompute, largest_recompute_group, recompute_group_sizes


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


_FSDP_DIMS = ("dp", "hsdp", "efsdp")
"""Mesh dimensions FSDP shards over (and gathers back): dp_shard(_cp), HSDP's, and the experts'
efsdp (dtgpt.parallel.dims); the others (tp, ep) stay split."""


def _numel_gathered_over_dp(p: torch.Tensor) -> int:
    """The size this rank's copy has once FSDP has all-gathered it (the tp shard only)."""
    if not isinstance(p, DTensor):
        return p.numel()
    shape = list(p.shape)
    mesh, coord = p.device_mesh, p.device_mesh.get_coordinate()
    for i, placement in enumerate(p.placements):
        if isinstance(placement, Shard) and not mesh.mesh_dim_names[i].startswith(_FSDP_DIMS):
            shape[placement.dim] = rows_of(shape[placement.dim], mesh.size(i), coord[i])
    return math.prod(shape)


def _unique_params(module: nn.Module) -> list[torch.Tensor]:
    return list({id(p): p for p in module.parameters()}.values())


def _trimmed(whole: GPT, layer_names: list[str]) -> GPT:
    """A deep copy of `whole` holding only the named blocks (cheap to cut into stages)."""
    shell = copy.copy(whole)
    shell._modules = dict(whole._modules)  # copy.copy shares the module dict
    shell.layers = nn.ModuleDict({n: whole.layers[n] for n in layer_names})
    return copy.deepcopy(shell)


def _stage_layer_names(counts: list[int], stage_ids: list[int]) -> list[str]:
    names = []
    for sid in stage_ids:
        first = sum(counts[:sid])
        names += [str(i) for i in range(first, first + counts[sid])]
    return names


@dataclass
class BuiltRank:
    """What one build of a rank yields, independent of its pp position's schedule."""

    stage_ids: list[int]
    layer_ids: list[int]
    recompute: list[str]
    """Per block: 'full', 'selective' or 'none', as dtgpt.parallel.recompute set it up."""
    recompute_group: int
    """The most blocks recomputed at once (0: no full recomputation)."""
    recompute_groups: int
    """Recomputed groups: each keeps its input."""
    local: int
    local_muon: int
    """Of `local`, the elements of the matrices Muon steps (under optimizer.optimizer = "muon")."""
    gathered: int
    largest_unit: int
    stage_params: int
    first: bool
    last: bool


def _build_rank(cfg: Config, world_size: int, rank: int, whole: GPT, layer_names: list[str]) -> BuiltRank:
    """Build `rank`'s parts under the fake process group through the training code path."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        dims = ParallelDims.from_config(cfg, world_size)
        dims.build_mesh("cpu")
        parts, stage_ids, num_stages = build_meta_parts(cfg, dims, _trimmed(whole, layer_names))
        named: dict[int, tuple[str, torch.Tensor]] = {}  # each parameter once, by its first name (as build_optimizer)
        for name, p in (item for part in parts for item in part.named_parameters()):
            named.setdefault(id(p), (name, p))
        params = [p for _, p in named.values()]
        units = [b for part in parts for b in part.layers.values()]
        units += [m for part in parts for m in (part.embedding, part.output) if m is not None]
        blocks = [(int(n), b) for part in parts for n, b in part.layers.items()]
        return BuiltRank(
            stage_ids=list(stage_ids),
            layer_ids=[n for n, _ in blocks],
            recompute=[kind for part in parts for kind in block_recompute(part).values()],
            recompute_group=max(largest_recompute_group(part) for part in parts),
            recompute_groups=sum(len(recompute_group_sizes(part)) for part in parts),
            local=sum(_local_numel(p) for p in params),
            local_muon=sum(_local_numel(p) for name, p in named.values() if is_muon_matrix(name, p)),  # dtgpt.muon's matrices
            gathered=sum(_numel_gathered_over_dp(p) for p in params),
            largest_unit=max((sum(_numel_gathered_over_dp(p) for p in _unique_params(u)) for u in units), default=0),
            stage_params=sum(p.numel() for p in params),
            first=0 in stage_ids,
            last=num_stages - 1 in stage_ids,
        )
    finally:
        dist.destroy_process_group()


def build_ranks(cfg: Config, world_size: int, vocab: int, *, dp_ranks=(0,), all_ranks: bool = False):
    """Build every (pp rank, tp rank) at the given dp ranks; returns [(rank, coords, BuiltRank)], builds.

    pp ranks whose stages hold the same kind of parts (layer counts, embedding, head, which blocks
    are MoE) are built
    once unless all_ranks is set (recomputation counts blocks within a stage, so it is the same).
    """
    if dist.is_initialized():
        raise RuntimeError("the planner needs its own (fake) process group: run it without torchrun")
    dims = ParallelDims.from_config(cfg, world_size)
    p = cfg.parallel
    counts = stage_layer_counts(cfg) if dims.pp_enabled else [cfg.model.num_layers]
    num_stages = len(counts)
    with torch.device("meta"):
        whole = GPT(cfg.model, vocab)
    cache: dict[tuple, tuple[int, BuiltRank]] = {}
    out = []
    for pp_rank in range(dims.pp):
        sids = stage_ids_on_rank(pp_rank, dims.pp, p.virtual_pipeline_stages_per_rank, p.pipeline_schedule)
        sids = sids if dims.pp_enabled else [0]
        names = _stage_layer_names(counts, sids)
        kind = (tuple(counts[s] for s in sids), 0 in sids, num_stages - 1 in sids)
        kind += (tuple(cfg.model.is_moe_layer(int(n)) for n in names),)  # dense-first MoE: blocks differ
        if all_ranks:
            kind += (pp_rank,)
        for dp_rank in dp_ranks:
            for tp_rank in range(dims.tp):
                # cp rank 0 stands for its cp peers: the same parts, FSDP shards of the same size
                rank = ((pp_rank * dims.dp + dp_rank) * dims.cp) * dims.tp + tp_rank
                key = kind + (dp_rank, tp_rank)
                if key not in cache:
                    cache[key] = (rank, _build_rank(cfg, world_size, rank, whole, names))
                built_as, built = cache[key]
                if built_as != rank:  # the same parts under other block names
                    built = BuiltRank(**{**asdict(built), "stage_ids": sids, "layer_ids": [int(n) for n in names]})
                out.append((rank, (pp_rank, dp_rank, tp_rank), built, built_as))
    return out, len(cache)
