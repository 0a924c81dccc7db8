"""ParallelDims: the one object that owns the DeviceMesh and answers "which group is X?".

Mesh dimensions, outer to inner: pp, dp_replicate, dp_shard, tp. tp is innermost so its ranks
are neighbours (one node); dp = dp_replicate * dp_shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtgpt.config import Config, mesh_shape, validate_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    mesh: DeviceMesh | None = field(default=None, repr=False)
    dp_mesh: DeviceMesh | None = field(default=None, repr=False)
    """dp_replicate x dp_shard flattened; kept here because torch no longer slices it from the root."""

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "ParallelDims":
        """Resolve dp_shard = -1 to the rest and check the product (before any group exists)."""
        validate_mesh(cfg, world_size)
        pp, dpr, dps, tp = mesh_shape(cfg, world_size)
        return cls(pp=pp, dp_replicate=dpr, dp_shard=dps, tp=tp, world_size=world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def fsdp_enabled(self) -> bool:
        # With one data-parallel rank FSDP would only add hooks; mixed precision is autocast anyway.
        return self.dp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the named 4-D mesh (and the flattened 'dp' view); None in a one-process run."""
        if not dist.is_initialized():
            return None
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        self.mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        self.dp_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        # A parameter sharded over dp_shard and tp has a partial norm on both dimensions: with
        # this flattened view DTensor reduces it in one all-reduce, in one order on every rank,
        # instead of two in sequence.
        self.mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
        return self.mesh

    def sub(self, name: str) -> DeviceMesh | None:
        """mesh['tp'], mesh['pp'], mesh['dp'] ...; None when there is no mesh."""
        if self.mesh is None:
            return None
        return self.dp_mesh if name == "dp" else self.mesh[name]

    def fsdp_mesh(self) -> DeviceMesh:
        """2-D (replicate, shard) for HSDP, else the shard dimension alone."""
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    def coordinate(self, name: str) -> int:
        """This rank's index along mesh dimension `name` (0 without a mesh)."""
        if self.mesh is None:
            return 0
        return self.sub(name).get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    @property
    def tp_rank(self) -> int:
        return self.coordinate("tp")

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")

    def all_reduce(self, tensor: torch.Tensor, names: tuple[str, ...], op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce over each named dimension of size > 1 (no-op without a mesh)."""
        if self.mesh is None:
            return tensor
        for name in names:
            mesh = self.sub(name)
            if mesh.size() > 1:
                dist.all_reduce(tensor, op=op, group=mesh.get_group())
        return tensor
