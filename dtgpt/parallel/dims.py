"""ParallelDims: the one object that owns the DeviceMesh and answers "which group is X?".

Mesh dimensions, outer to inner: pp, dp_replicate, dp_shard, cp, tp. tp is innermost so its
ranks are neighbours (one node), cp next to it. dp = dp_replicate * dp_shard counts the ranks that
read different samples; cp ranks read the same samples and hold different pieces of each
sequence, so what sums over tokens (the loss, its token count, gradients) runs over dp x cp
("dp_cp"), and FSDP shards over dp_shard x cp ("dp_shard_cp"), as torchtitan does.

Expert parallelism adds no dimension of its own: its ep ranks are folded out of dp_shard x cp
(cp innermost, so ep = dp_shard / efsdp x cp), "ep" over neighbouring ranks, and the experts'
FSDP shards over the "efsdp" ranks that remain (dtgpt/parallel/expert.py).

tp folds into the MoE layers' FSDP as Megatron folds it into its expert-data-parallel group
(expert tp = 1): the router and the experts are whole on every tp rank, each rank computing on
its own sequence chunk, so their gradients are sums over dp_shard x cp x tp, which one
reduce-scatter per FSDP unit does over the flattened view ("moe_fsdp", and under ep "efsdp_tp").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtgpt.config import Config, low_precision, mesh_shape, validate_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    ep: int = 1
    """Expert-parallel ranks, folded out of dp_shard x cp (not a factor of world_size)."""
    low_precision: bool = False
    """fp16/bf16: FSDP casts the parameters even at dp = cp = 1 (dtgpt/parallel/fsdp.py)."""
    moe: bool = False
    """The model has MoE layers: under tp with FSDP their FSDP units span tp too (tp_folds_into_moe)."""
    mesh: DeviceMesh | None = field(default=None, repr=False)
    flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    """Flattened views ('dp', 'dp_cp', 'dp_shard_cp', and HSDP's 'hsdp_cp'); kept here because
    torch no longer slices them from the root."""
    slices: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    """The root's one-dimension slices ('tp', 'pp', ...), each made once: slicing builds a new
    DeviceMesh (~26 aten ops on its rank tensor), and a step asks for some every iteration."""

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "ParallelDims":
        """Resolve dp_shard = -1 to the rest and check the product (before any group exists)."""
        validate_mesh(cfg, world_size)
        pp, dpr, dps, cp, tp = mesh_shape(cfg, world_size)
        ep = cfg.parallel.expert_model_parallel_size
        return cls(pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, world_size=world_size, ep=ep,
                   low_precision=low_precision(cfg), moe=cfg.model.moe_enabled)  # fmt: skip

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(pp, dp_replicate, dp_shard, cp, tp): the mesh, outer to inner."""
        return self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp

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
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        # cp ranks share every weight, so they shard it like dp ranks. With one rank per stage and
        # tp slice an fp32 run needs no FSDP; fp16/bf16 runs need a cast of the parameters: FSDP's
        # for an MoE model, a compute copy otherwise (dtgpt.parallel.uses_compute_copy).
        return self.dp * self.cp > 1 or self.low_precision

    @property
    def tp_folds_into_moe(self) -> bool:
        """The MoE layers' router and experts are FSDP-sharded over dp_shard x cp x tp, their
        gradients reduced in one reduce-scatter per unit. Without FSDP they stay replicated over
        tp, their partial gradients summed in one bucket (ModelParts.reduce_pending_grads); under
        HSDP too (FSDP's per-parameter sum over tp: a 2-D folded mesh is not built)."""
        return self.moe and self.tp_enabled and self.fsdp_enabled and self.dp_replicate == 1

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the named 5-D mesh and its flattened views; None in a one-process run."""
        if not dist.is_initialized():
            return None
        self.mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        self.slices.clear()
        self.flat["dp"] = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        shard = ("dp_shard", "cp") if self.cp_enabled else ("dp_shard",)
        if self.cp_enabled:
            self.flat["dp_cp"] = self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            self.flat["dp_shard_cp"] = self.mesh[shard]._flatten("dp_shard_cp")
            if self.dp_replicate > 1:  # HSDP's 2-D mesh, built once (slicing flattened dims is deprecated)
                hsdp = (self.dp_replicate, self.dp_shard * self.cp)
                self.flat["hsdp_cp"] = self.flat["dp_cp"]._unflatten(0, hsdp, ("dp_replicate", "dp_shard_cp"))
        else:  # the same ranks: no second group
            self.flat["dp_cp"], self.flat["dp_shard_cp"] = self.flat["dp"], self.mesh["dp_shard"]
        # A parameter sharded over FSDP's shard dimension and tp has a partial norm on both: with
        # this flattened view DTensor reduces it in one all-reduce, in one order on every rank,
        # instead of two in sequence (DTensor finds a flattened view by the ranks it spans).
        shard_tp = self.mesh[(*shard, "tp")]._flatten("_".join((*shard, "tp")))
        if self.tp_folds_into_moe:
            self.flat["moe_fsdp"] = shard_tp
        if self.cp_enabled and self.tp_enabled:  # see sequence_mesh
            self.flat["cp_tp"] = self.mesh["cp", "tp"]._flatten("cp_tp")
        if self.ep_enabled:
            self._build_expert_meshes()
        return self.mesh

    def _build_expert_meshes(self) -> None:
        """'ep' (the experts' all-to-all), 'efsdp' (their FSDP shards), 'ep_tp' (where each
        expert parameter lives) and, with dp_replicate, 'hsdp_efsdp' (their HSDP mesh)."""
        efsdp = self.dp_shard * self.cp // self.ep
        expert = self.flat["dp_cp"]._unflatten(0, (self.dp_replicate, efsdp, self.ep), ("dp_replicate", "efsdp", "ep"))
        self.flat["ep"], self.flat["efsdp"] = expert["ep"], expert["efsdp"]
        if self.dp_replicate > 1:
            self.flat["hsdp_efsdp"] = expert["dp_replicate", "efsdp"]
        if self.tp_folds_into_moe:  # the experts' FSDP spans efsdp x tp; each tp rank keeps the same ep groups
            names = ("dp_replicate", "dp_shard", "cp", "tp")
            with_tp = self.mesh[names]._flatten("dp_cp_tp")._unflatten(0, (1, efsdp, self.ep, self.tp), ("dp_replicate", "efsdp", "ep", "tp"))
            self.flat["efsdp_tp"] = with_tp["efsdp", "tp"]._flatten("efsdp_tp")
        elif self.tp_enabled:
            self.flat["ep_tp"] = DeviceMesh._concatenate([expert["ep"], self.mesh["tp"]])

    def release_groups(self) -> None:
        """Drop the meshes' references to their process groups, once the groups are destroyed.

        torch's DTensor caches keep the meshes they met for the life of the process, and a mesh
        keeps its groups: gloo's threads would then outlive `destroy_process_group` and run on
        while the exiting process tears down its static objects (a rank crashed at exit, SIGSEGV,
        once in hundreds of runs). Without those references the groups go, threads joined."""
        meshes = [self.mesh, *self.flat.values(), *self.slices.values()]
        for mesh in meshes + [m._get_root_mesh() for m in meshes if m is not None]:
            registry = getattr(mesh, "_pg_registry", None)  # (torch >= 2.12; older meshes hold names only)
            if registry:
                registry.clear()

    def sub(self, name: str) -> DeviceMesh | None:
        """mesh['tp'], mesh['pp'], mesh['dp'], mesh['dp_cp'] ...; None when there is no mesh."""
        if self.mesh is None:
            return None
        if name in self.flat:
            return self.flat[name]
        if name not in self.slices:
            self.slices[name] = self.mesh[name]
        return self.slices[name]

    def fsdp_mesh(self) -> DeviceMesh:
        """2-D (replicate, shard) for HSDP, else the shard dimension alone; cp shards like dp_shard."""
        if self.dp_replicate == 1:
            return self.flat["dp_shard_cp"]
        return self.flat["hsdp_cp"] if self.cp_enabled else self.mesh["dp_replicate", "dp_shard"]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The experts' FSDP mesh: the dp ranks that remain once ep is folded out (HSDP: 2-D),
        with tp where it folds in."""
        if self.tp_folds_into_moe:
            return self.flat["efsdp_tp"]
        return self.flat["hsdp_efsdp"] if self.dp_replicate > 1 else self.flat["efsdp"]

    def expert_mesh(self) -> DeviceMesh:
        """Where an expert parameter lives: sharded over ep, and replicated over tp unless tp
        folds into its FSDP shards."""
        return self.flat["ep_tp"] if "ep_tp" in self.flat else self.flat["ep"]

    def moe_fsdp_mesh(self) -> DeviceMesh | None:
        """The FSDP mesh of each MoE layer's router (and, without ep, its experts): dp_shard x cp
        x tp, where tp folds in; else None."""
        return self.flat.get("moe_fsdp")

    def sequence_mesh(self) -> DeviceMesh:
        """The ranks that hold chunks of the same sequences: cp x tp (tp under sequence parallelism)."""
        if self.cp_enabled and self.tp_enabled:
            return self.flat["cp_tp"]
        return self.mesh["cp"] if self.cp_enabled else self.mesh["tp"]

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

    @property
    def cp_rank(self) -> int:
        return self.coordinate("cp")

    def all_reduce(self, tensor: torch.Tensor, names: tuple[str, ...], op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce over each named dimension of size > 1 (no-op without a mesh)."""
        if self.mesh is None:
            return tensor
        for name in names:
            mesh = self.sub(name)
            if mesh.size() > 1:
                dist.all_reduce(tensor, op=op, group=mesh.get_group())
        return tensor
