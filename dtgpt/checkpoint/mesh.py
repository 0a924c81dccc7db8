"""The mesh a checkpoint was saved on, as its completion marker records it: what decides which
stages and shards each rank held, and whether saved RNG states still apply."""

from __future__ import annotations

from dtgpt.config import Config
from dtgpt.parallel import ParallelDims
from dtgpt.parallel.pipeline import stage_layer_counts


def mesh_info(cfg: Config, dims: ParallelDims) -> dict:
    """What decides which stages and shards a rank holds (RNG states are only reused if equal)."""
    p = cfg.parallel
    return {
        "world_size": dims.world_size, "pp": dims.pp, "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp, "pipeline_schedule": p.pipeline_schedule if dims.pp > 1 else "",
        "virtual_pipeline_stages_per_rank": p.virtual_pipeline_stages_per_rank if dims.pp > 1 else 1,
        "layers_per_stage": stage_layer_counts(cfg) if dims.pp > 1 else [],
    }  # fmt: skip


def mesh_text(mesh: dict | None) -> str:
    if not isinstance(mesh, dict) or not mesh:
        return "unknown mesh"
    # A checkpoint from before context parallelism has no "cp": it was saved at cp=1.
    text = " ".join(f"{k}={mesh.get(k, 1)}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    if mesh["pp"] > 1:
        text += f" {mesh['pipeline_schedule']} x{mesh['virtual_pipeline_stages_per_rank']}"
        if len(set(mesh.get("layers_per_stage", []))) > 1:  # an uneven split, as the startup line shows it
            text += f" blocks per stage {' '.join(map(str, mesh['layers_per_stage']))}"
    return text


def same_rng_coordinates(saved: dict | None, here: dict) -> bool:
    """Saved RNG states apply when every (pp, tp) coordinate holds the same stages as before:
    dp and cp may change (their peers share their states), pp, the schedule, the blocks of each
    stage and tp may not. A marker written before the blocks per stage were recorded is taken at
    its word for them."""
    keys = ("pp", "tp", "pipeline_schedule", "virtual_pipeline_stages_per_rank")
    if saved is None or any(saved.get(k) != here[k] for k in keys):
        return False
    return saved.get("layers_per_stage", here["layers_per_stage"]) == here["layers_per_stage"]
