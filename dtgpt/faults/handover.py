"""The state handover of in-process recovery (recovery.py): survivors copy their own shards into
model and optimizer objects rebuilt on the new mesh, and a replacement receives its shards from
its replica twin, over the new groups.

What a rank holds of the train state, in one order that every rank of one replica-twin group
(the ranks with equal pp/dp_shard/cp/tp coordinates) agrees on, since they built the same
model the same way:

- per model part, per parameter in its optimizer's order: the parameter's local shard, then its
  optimizer state (AdamW: step, exp_avg, exp_avg_sq) by key;
- per model part, its buffers' local values;
- as objects: progress, LR schedule, loss scale, run health, the RNG states at the start of
  the iteration to be redone, and the metrics logger's `kept` (the last iteration's record and
  the open log interval): a replacement of the logging rank writes that record when the logging
  rank died before it did (docs/faults.md, "The record of the last iteration").

The optimizer's parameters are FSDP's sharded ones, never the unsharded copies that a forward
interrupted mid-way left on the modules; they did not change in the interrupted iteration (the
consistency rule: nobody was inside the optimizer step).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtgpt.state import TrainState


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _param_pairs(state: TrainState) -> Iterator[tuple[torch.optim.Optimizer, torch.Tensor]]:
    for opt in state.optimizer.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                yield opt, p


def optimizer_layout(state: TrainState) -> list[dict[str, tuple]]:
    """Per parameter, its optimizer state's layout: key -> (is a DTensor, dtype, local shape, on
    the CPU: AdamW keeps `step` there unless capturable)."""
    return [
        {key: (isinstance(v, DTensor), str(v.dtype).removeprefix("torch."), tuple(_local(v).shape), v.device.type == "cpu")
         for key, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor)}
        for opt, p in _param_pairs(state)
    ]  # fmt: skip


def allocate(state: TrainState, layout: list[dict[str, tuple]]) -> None:
    """Give `state`'s (fresh, stateless) optimizers empty state of `layout`, laid out like each parameter."""
    for (opt, p), keys in zip(_param_pairs(state), layout, strict=True):
        entry = {}
        for key, (is_dtensor, dtype, shape, on_cpu) in keys.items():
            dtype, device = getattr(torch, dtype), "cpu" if on_cpu else _local(p).device
            entry[key] = torch.zeros_like(p, dtype=dtype) if is_dtensor else torch.zeros(shape, dtype=dtype, device=device)
        if entry:
            opt.state[p] = entry


def tensors(state: TrainState) -> list[torch.Tensor]:
    """This rank's local tensors of model and optimizer, in the module doc's order."""
    out = []
    for opt, p in _param_pairs(state):
        out.append(_local(p))
        out.extend(_local(v) for _, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor))
    for part in state.model.parts:
        out.extend(_local(b) for _, b in part.named_buffers())
    return out


@torch.no_grad()
def copy_tensors(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    """dst[i] <- src[i]: a survivor's own shards into the objects rebuilt on the new mesh."""
    if len(src) != len(dst):
        raise RuntimeError(f"the rebuilt model holds {len(dst)} local tensors, the old one {len(src)}")
    for s, d in zip(src, dst):
        if s.shape != d.shape:
            raise RuntimeError(f"a local shard changed shape on the rebuilt mesh: {tuple(s.shape)} -> {tuple(d.shape)}")
        d.copy_(s)


def scalars(state: TrainState) -> dict:
    """The train state that is no tensor of the model or optimizer."""
    return {
        "progress": state.progress.state_dict(), "lr_schedule": state.lr_schedule.state_dict(),
        "scaler": state.scaler.state_dict(), "health": dataclasses.asdict(state.health),
    }  # fmt: skip


def load_scalars(state: TrainState, values: dict) -> None:
    state.progress.load_state_dict(values["progress"])
    state.lr_schedule.load_state_dict(values["lr_schedule"])
    state.scaler.load_state_dict(values["scaler"])
    state.health = dataclasses.replace(state.health, **values["health"])


@torch.no_grad()
def broadcast_tensors(tensors_: list[torch.Tensor], src: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """Every tensor from global rank `src` to the rest of `group`, one flat buffer per dtype on
    `device` (the backend's: NCCL moves no CPU tensor)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors_:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group_tensors = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1).to(device) for t in group_tensors])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in group_tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view(t.shape))
            offset += n


def hand_over(state: TrainState, twins: list[int], newcomers: set[int], own: dict | None) -> dict:
    """Collective over the new world: fill `state` (rebuilt on the new mesh) and return the
    scalars and RNG states this rank resumes with. `twins`: this rank's replica-twin group
    (global ranks); `own`: a survivor's {"tensors", "layout", "scalars", "rng", "metrics"} from
    its old objects, None on a replacement. The first survivor of a group with a newcomer sends."""
    if own is not None:
        allocate(state, own["layout"])
        copy_tensors(own["tensors"], tensors(state))
    if not newcomers & set(twins):
        return {"scalars": own["scalars"], "rng": own["rng"], "metrics": own["metrics"]}
    source = min(r for r in twins if r not in newcomers)
    group = state.model.dims.sub("dp_replicate").get_group()
    box = [{key: own[key] for key in ("layout", "scalars", "rng", "metrics")} if own is not None else None]
    dist.broadcast_object_list(box, src=source, group=group)
    received = box[0]
    if own is None:
        allocate(state, received["layout"])
    broadcast_tensors(tensors(state), source, group, state.model.device)
    return {"scalars": received["scalars"], "rng": received["rng"], "metrics": received["metrics"]}


def keep(state: TrainState, rng: dict, metrics: dict | None) -> dict:
    """A survivor's `own` for hand_over, from its old objects (read before their groups go);
    `metrics`: its metrics logger's `kept`. Device tensors are copied to the host, so that the
    old objects can be freed before the new ones are built: the device never holds two copies
    of the model and optimizer."""
    kept = [t.detach().to("cpu", copy=True) if t.device.type != "cpu" else t.detach() for t in tensors(state)]
    return {"tensors": kept, "layout": optimizer_layout(state), "scalars": scalars(state), "rng": rng, "metrics": metrics}
