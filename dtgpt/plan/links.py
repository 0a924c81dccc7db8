"""What crosses the links: the bytes one rank sends per iteration for the collectives of
dtgpt.plan.comm, split into the node's NVLink and the InfiniBand between nodes, and the time
they would take if nothing overlapped with compute."""

from __future__ import annotations

from dataclasses import dataclass

from dtgpt.plan.comm import Collective, CommLayout, rank_collectives


def group_size(c: CommLayout, dim: str) -> int:
    sizes = {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp, "dp_cp": c.dp * c.cp, "dp_shard": c.dp_shard,
             "dp_shard_cp": c.shard, "dp_replicate": c.dp_replicate, "dp_shard_tp": c.shard * c.tp, "tied": 2,
             "ep": c.ep, "efsdp": c.efsdp, "cp_tp": c.cp * c.tp, "moe_fsdp": c.shard * c.tp, "efsdp_tp": c.efsdp * c.tp,
             "world": c.pp * c.dp * c.cp * c.tp}  # fmt: skip
    return sizes[dim]


def link_bytes(col: Collective, n: int) -> float:
    """Bytes one rank sends (and receives) for `col` in a ring of n ranks: (n-1)/n of the
    message for all-gather, reduce-scatter and all-to-all, twice that for all-reduce, all of it for a send."""
    if col.kind in ("send", "recv"):
        return col.bytes
    if col.kind == "all_to_all":  # a rank keeps its own 1/n of the message
        return col.bytes * (n - 1) / n if n > 1 else 0.0
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if col.kind == "all_reduce" else (n - 1) / n
    return col.bytes * factor


NVLINK_GBPS = 300.0
"""GB/s one GPU sends over NVLink within its node (A100 NVLink 3, per direction)."""
INFINIBAND_GBPS = 25.0
"""GB/s one GPU sends across nodes (one 200 Gb/s HDR InfiniBand adapter per GPU, as in
Narayanan et al. 2021's A100 cluster)."""
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class RankTraffic:
    pp_rank: int
    sent_bytes: float
    """sent per iteration (received is the same): tp over NVLink plus the rest over InfiniBand"""
    nvlink_bytes: float
    seconds: float
    """if nothing overlapped with compute: nvlink_bytes / NVLink + the rest / InfiniBand"""


def rank_traffic(
    c: CommLayout, pp_rank: int, n_micro: int, nvlink_gbps: float = NVLINK_GBPS, ib_gbps: float = INFINIBAND_GBPS
) -> RankTraffic:
    """What one rank at pipeline coordinate pp_rank moves per iteration: tp stays within the node
    (innermost mesh dimension), and so does cp (next to it) when cp x tp fits a node; pp and dp
    cross nodes."""
    nvlink = other = 0.0
    within_node = {"tp", "cp", "cp_tp"} if c.cp * c.tp <= GPUS_PER_NODE else {"tp"}
    if c.ep * c.tp <= GPUS_PER_NODE:  # an ep group is ep neighbours at stride tp (dtgpt.parallel.dims)
        within_node.add("ep")
    for col in rank_collectives(c, pp_rank, n_micro):
        moved = link_bytes(col, group_size(c, col.dim))
        if col.dim in within_node:
            nvlink += moved
        else:
            other += moved
    seconds = nvlink / (nvlink_gbps * 1e9) + other / (ib_gbps * 1e9)
    return RankTraffic(pp_rank, nvlink + other, nvlink, seconds)
