"""What a plan is: one row per rank, the whole-job figures, and the error for an impossible layout.

Plain records, filled by dtgpt.plan.layout and read by dtgpt.plan.report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dtgpt.config import ConfigError


class LayoutError(ConfigError):
    """The layout cannot run at all; `errors` lists every rule it breaks that the planner found."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass
class RankPlan:
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    stage_ids: list[int]
    layer_ids: list[int]
    recomputed_layers: int
    local_params: int
    """What this GPU holds: sum of p.to_local().numel() (the tp shard, and the dp shard under FSDP)."""
    stage_params: int
    """Full (unsharded) size of this rank's stages, the tied copy included."""
    in_flight: int
    memory: dict[str, float] = field(default_factory=dict)
    """GiB per term: params, copies, grads, adam, activations, total."""
    built_as: int = -1
    """The global rank whose build this row reuses (itself when built)."""

    @property
    def layers(self) -> int:
        return len(self.layer_ids)

    @property
    def memory_gib(self) -> float:
        return self.memory["total"]


@dataclass
class Plan:
    world_size: int
    mesh: dict[str, int]
    vocab_size: int
    padded_vocab_size: int
    total_params: int
    microbatches: int
    microbatches_initial: int
    microbatch_counts: list[int]
    """every micro-batch count of the run (one per batch size a ramp-up reaches), ascending"""
    bubble_fraction: float
    bubble_fraction_initial: float
    flops_per_token: float
    hardware_flops_per_token: float
    flops_per_iteration: float
    tokens_per_iteration: int
    est_iteration_s: float
    est_days: float
    tflops: float
    tokens: float
    gpu_memory_gib: float
    ranks: list[RankPlan]
    builds: int
    active_params: int = 0
    """The parameters one token uses: all of them, but k of each MoE layer's experts."""
    mtp_params: int = 0
    """The multi-token prediction modules' own parameters, apart from total_params (as DeepSeek counts)."""
    all_to_all_bytes: list = field(default_factory=list)
    """Per pp rank: the message bytes a rank's expert-parallel all-to-alls send per iteration."""
    comm: list = field(default_factory=list)
    """dtgpt.plan.links.RankTraffic per pp rank: bytes each rank sends per iteration, and their time."""
    est_comm_s: float = 0.0
    """the slowest pp rank's communication time per iteration, not overlapped with compute"""
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(r.memory_gib <= self.gpu_memory_gib for r in self.ranks)

    def to_dict(self) -> dict:
        out = asdict(self)
        for row, rank in zip(out["ranks"], self.ranks):
            row["layers"] = rank.layers
            row["memory_gib"] = rank.memory_gib
        out["fits"] = self.fits
        return out
