"""ParallelDims' expert meshes, built under PyTorch's fake process group (no ranks launched): ep
is folded out of dp_shard x cp (neighbouring ranks, cp innermost), efsdp holds the ranks that
remain, and an expert parameter lives on (ep, tp)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dtgpt.parallel.dims import ParallelDims


def build(rank: int, *, dp_shard: int, cp: int, tp: int, ep: int, dp_replicate: int = 1, moe: bool = False) -> ParallelDims:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    world = dp_replicate * dp_shard * cp * tp
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    dims = ParallelDims(pp=1, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, world_size=world, ep=ep, moe=moe)
    dims.build_mesh("cpu")
    return dims


def ranks(mesh) -> list:
    return mesh.mesh.tolist()


# rank = ((dp_replicate * dp_shard + dp_shard index) * cp + cp index) * tp + tp index
@pytest.mark.parametrize(
    "rank, shape, ep_ranks, efsdp_ranks, expert_ranks, expert_fsdp_ranks",
    [
        # ep spans both cp ranks and 2 dp_shard ranks; the experts' FSDP the 2 that remain
        (5, dict(dp_shard=4, cp=2, tp=1, ep=4), [4, 5, 6, 7], [1, 5], [4, 5, 6, 7], [1, 5]),
        (3, dict(dp_shard=4, cp=1, tp=1, ep=2), [2, 3], [1, 3], [2, 3], [1, 3]),
        # tp innermost: an ep group holds one tp coordinate; an expert lives on (ep, tp)
        (3, dict(dp_shard=2, cp=2, tp=2, ep=2), [1, 3], [3, 7], [[0, 1], [2, 3]], [3, 7]),
        # HSDP: the experts are replicated over dp_replicate and sharded over efsdp (here 1 rank)
        (3, dict(dp_replicate=2, dp_shard=2, cp=1, tp=1, ep=2), [2, 3], [3], [2, 3], [[1], [3]]),
    ],
)
def test_ep_folds_out_of_dp_shard_and_cp(rank, shape, ep_ranks, efsdp_ranks, expert_ranks, expert_fsdp_ranks):
    try:
        dims = build(rank, **shape)
        assert dims.ep_enabled
        assert ranks(dims.sub("ep")) == ep_ranks and ranks(dims.sub("efsdp")) == efsdp_ranks
        assert ranks(dims.expert_mesh()) == expert_ranks and ranks(dims.expert_fsdp_mesh()) == expert_fsdp_ranks
    finally:
        dist.destroy_process_group()


def test_no_expert_meshes_without_ep():
    try:
        dims = build(0, dp_shard=2, cp=1, tp=1, ep=1)
        assert not dims.ep_enabled and "ep" not in dims.flat
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "shape, expert_ranks, expert_fsdp_ranks, moe_fsdp_ranks",
    [
        # ep2: an expert lives on ep alone; its FSDP spans efsdp x tp; the router's all 8 ranks
        (dict(dp_shard=2, cp=2, tp=2, ep=2), [1, 3], [2, 3, 6, 7], list(range(8))),
        # no ep: the router and experts share one unit over dp_shard x tp
        (dict(dp_shard=2, cp=1, tp=2, ep=1), None, None, [0, 1, 2, 3]),
    ],
)
def test_tp_folds_into_the_moe_layers_fsdp(shape, expert_ranks, expert_fsdp_ranks, moe_fsdp_ranks):
    """Under tp with FSDP, an MoE model's routers and experts are FSDP-sharded over tp too (as
    Megatron's expert-data-parallel group with expert tp 1), so one reduce-scatter per unit sums
    their gradients over dp and tp; rank 3 here."""
    try:
        dims = build(3, **shape, moe=True)
        assert dims.tp_folds_into_moe and ranks(dims.moe_fsdp_mesh()) == moe_fsdp_ranks
        if expert_ranks is not None:
            assert ranks(dims.expert_mesh()) == expert_ranks and ranks(dims.expert_fsdp_mesh()) == expert_fsdp_ranks
    finally:
        dist.destroy_process_group()


def test_no_folding_without_fsdp_or_under_hsdp():
    for shape in (dict(dp_shard=1, cp=1, tp=2, ep=1), dict(dp_replicate=2, dp_shard=1, cp=1, tp=2, ep=1)):
        try:
            dims = build(0, **shape, moe=True)
            assert not dims.tp_folds_into_moe and dims.moe_fsdp_mesh() is None
        finally:
            dist.destroy_process_group()
