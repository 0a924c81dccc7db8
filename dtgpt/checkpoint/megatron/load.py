"""A Megatron-LM checkpoint into dtgpt: a TrainState at any mesh, each rank reading only what it
holds (load_into_state), or a plain one-device GPT (load_megatron_model).

Every parameter (and AdamW tensor) of a rank is a DTensor shard or a whole tensor; its global
offset and local shape name a region of Megatron's stored tensor (one layer of a stacked one),
and MegatronReader.regions reads just that region, touching only the stored chunks it overlaps.
A rank's extra memory is its own shards, not whole stacked tensors.

Megatron's Adam state in model space (its non-distributed optimizers, and the distributed
optimizer's `fully_reshardable` and `fully_sharded_model_space` sharding types) is stored under
`optimizer.state.<slot>.<model key>`, each shaped as the model tensor, so the weights' key map,
QKV layout and vocabulary rows carry over:

    exp_avg, exp_avg_sq      AdamW's exp_avg, exp_avg_sq of the dtgpt parameter (the same
                             vocabulary rows: MegatronReader.check refuses other ones)
    fp32_param or param      the fp32 master weights: they, not the (maybe bf16) model weights,
                             become dtgpt's fp32 parameters
    step                     common.pt: the optimizer's param_groups[*]["step"] (or common_step)

The distributed optimizer's default sharding type, `dp_reshardable`, keeps the same three slots
(param, exp_avg, exp_avg_sq) in flat per-bucket tensors instead, and its param groups in a pickled
item; MegatronReader maps each parameter's region into them (buckets.py: at any tp and pp it was
saved with), so the same read_into fills AdamW from either layout. Model-space master weights are
checked against the model weights as the buckets' are (MegatronReader.masters_agree): state that
is not where it belongs (megatron-core 0.16.1's multi-bucket fully_reshardable save) starts fresh.
The per-rank format's state (each file's optimizer state by parameter index, or the distributed
optimizer's distrib_optim.pt) is read under the same `optimizer.state.<slot>.<model key>` names
(per_rank_optim.py).

Under optimizer.optimizer = "muon" the state is megatron-core's Muon chain's (muon.py's
get_megatron_muon_optimizer: a ChainedOptimizer of its TensorParallelMuon and its Adam, each an
FP32Optimizer, or Float16OptimizerWithFloat16Params under bf16; Megatron-LM refuses its
distributed optimizer with muon, and dist_muon's LayerWiseDistributedOptimizer saves the same
keys). Megatron-LM saves it with chained_optim_avoid_prefix, so each chained optimizer's tensors
are in model space under the same names as Adam's, the two disjoint:

    momentum_buffer          Muon's momentum of each of its matrices (a fused QKV weight whole,
                             SwiGLU's [gate; fc1] as linear_fc1, as the weights): dtgpt's
                             MuonWithAdamW keeps it under the same name, sharded as the parameter
    exp_avg, exp_avg_sq      AdamW's moments of the rest (embedding, output layer, biases, norms)
    fp32_param               (bf16) the master weights of both
    step                     the Adam half's common_step (Muon keeps none)

Which parameters are Muon's is dtgpt.muon's rule, megatron-core's: a checkpoint whose state does
not follow it (a Muon checkpoint into AdamW, or the reverse) starts fresh with a note naming the
first missing tensor. Under optimizer.optimizer = "sgd" no optimizer state is read (the weights,
counts, LR schedule and loss scale are), with a note in the log.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from dtgpt.checkpoint.megatron.formats import progress_of
from dtgpt.checkpoint.megatron.scheduler import follow_weight_decay
from dtgpt.checkpoint.megatron.keys import MOMENTS, MOMENTUM, dtgpt_names, full_model_shapes, is_buffer, megatron_name
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import Config, ModelConfig
from dtgpt.model import GPT
from dtgpt.muon import is_muon_matrix
from dtgpt.parallel.regions import local_region
from dtgpt.state import FLAT_OPTIM, TrainState, tied_source

MASTER_SLOTS = ("fp32_param", "param")
"""Megatron's names for the master weights: Float16Optimizer and fully_sharded_model_space say
fp32_param, the distributed optimizer's fully_reshardable says param."""


@torch.no_grad()
def read_into(reader: MegatronReader, targets: dict[str, tuple[str, str | None, torch.Tensor]]) -> None:
    """targets: request -> (dtgpt name, optimizer slot or None, live tensor); each live tensor
    (DTensor shard or whole) is filled with its region of the checkpoint, one layer at a time
    (so the regions held besides the live tensors are one layer's)."""
    by_layer: dict[int | None, dict] = {}
    for request, (name, slot, value) in targets.items():
        offsets, sizes = local_region(value)
        if math.prod(sizes):  # an uneven FSDP split may leave a rank nothing of a tensor
            by_layer.setdefault(megatron_name(name)[1], {})[request] = (name, slot, offsets, sizes)
    for wanted in by_layer.values():
        for request, region in reader.regions(wanted).items():
            value = targets[request][2]
            (value.to_local() if isinstance(value, DTensor) else value).copy_(region)


def adam_step(optimizer_common) -> float | None:
    """Megatron's Adam step count where its common state keeps it: the param groups' "step"
    (distributed optimizer) or the state's "common_step" (the others); None when absent."""
    found = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "param_groups" and isinstance(value, list):
                    found.extend(float(g["step"]) for g in value if isinstance(g, dict) and "step" in g)
                elif key == "common_step":
                    found.append(float(value))
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(optimizer_common)
    return found[0] if found and len(set(found)) == 1 else None


def state_slots(name: str, shape: tuple[int, ...], muon: bool) -> tuple[str, ...]:
    """The optimizer slots besides the step that dtgpt's optimizer keeps for parameter `name`:
    Muon's momentum for the matrices Muon takes (under `muon`), else AdamW's moments."""
    return (MOMENTUM,) if muon and is_muon_matrix(name, torch.empty(shape, device="meta")) else MOMENTS


def optimizer_slots(reader: MegatronReader, shapes: dict[str, tuple[int, ...]], muon: bool) -> tuple[str | None, str | None]:
    """(the stored key of the first optimizer state dtgpt's optimizer needs that the checkpoint
    lacks, or None when it has all; the master-weight slot or None)."""
    params = [name for name in shapes if not is_buffer(name)]

    def stored(slot: str) -> bool:
        return all(reader.holds(name, slot) for name in params)

    wanted = ((name, slot) for name in params for slot in state_slots(name, shapes[name], muon))
    missing = next((reader.stored_key(name, slot) for name, slot in wanted if not reader.holds(name, slot)), None)
    return missing, next((s for s in MASTER_SLOTS if stored(s)), None)


def load_into_state(state: TrainState, directory: Path, cfg: Config, stateful: bool, counts: bool = False) -> list[str]:
    """Fill a TrainState (any mesh) from a Megatron checkpoint: the weights; with `stateful`,
    also the Adam state, iteration, consumed train and validation samples, LR schedule and loss
    scale that Megatron-LM stored; with `counts` alone, the iteration and sample counts
    (Megatron's --no-load-optim). Returns notes for the log."""
    reader = MegatronReader(directory)
    reader.check_architecture(cfg.model)
    full = full_model_shapes(cfg.model, state.model.parts[0].vocab_size)
    reader.check(full, list(full))  # the whole model on every rank: every rank fails alike
    adam, muon = cfg.optimizer.optimizer == "adam", cfg.optimizer.uses_muon  # the state read: Adam's, or Muon's and Adam's
    missing, master = optimizer_slots(reader, full, muon) if stateful and (adam or muon) else ("", None)
    has_moments = missing is None
    step = adam_step(reader.optimizer_common()) if has_moments else None
    in_buckets = has_moments and reader.bucket_layout()[0] is not None
    shifted = has_moments and step is not None and master is not None and not in_buckets and not reader.masters_agree(master)
    use_state = has_moments and step is not None and not shifted
    weights_slot = master if use_state else None
    for part in state.model.parts:
        live = get_model_state_dict(part)
        read_into(reader, {name: (_source(state, name), None if is_buffer(name) else weights_slot, value)
                           for name, value in live.items()})  # fmt: skip
    notes = []
    if use_state:
        _load_optimizer_state(state, reader, step)
        master_note = f"fp32 master weights ({weights_slot}), " if weights_slot else ""
        momentum_note = "Muon momentum, " if muon else ""
        notes.append(f"optimizer state loaded: {master_note}{momentum_note}Adam moments, step {step:g}")
        if in_buckets:
            buckets, spec = reader.bucket_layout()
            experts = f", {buckets.experts} experts" if buckets.experts else ""
            notes.append(f"optimizer state read from the distributed optimizer's dp_reshardable buckets ({spec} layer order{experts})")
    elif stateful:
        why = "common.pt holds no Adam step count"
        if shifted:
            why = (f"its fp32 master weights (optimizer.state.{master}.*) differ from the model weights, so its Adam state is not "
                   "where it belongs (megatron-core 0.16.1's fully_reshardable save of a grad buffer in several buckets shifts it)")
        if not has_moments:
            why = "the checkpoint holds no optimizer state in model space (optimizer.state.*)"
            if reader.holds_slot("exp_avg") or reader.holds_slot(MOMENTUM):
                why = f"the checkpoint holds no {missing}, which dtgpt's {'Muon' if muon else 'AdamW'} needs"
                if reader.holds_slot(MOMENTUM) != muon:  # Megatron's Adam keeps no momentum_buffer, its Muon and SGD do
                    why += f" (it holds {'Adam' if muon else 'Muon or SGD'} state: saved with another --optimizer?)"
        if not (adam or muon):
            why = f"optimizer.optimizer={cfg.optimizer.optimizer!r}, and only Adam's and Muon's state is read from Megatron"
        elif reader.per_rank_optimizer_problem():
            why = reader.per_rank_optimizer_problem()
        else:
            buckets, unmapped = reader.bucket_layout()
            if buckets is None and unmapped:
                why = f"its distributed optimizer state is in the dp_reshardable layout, but {unmapped}"
        fresh = "AdamW moments" if adam else ("Muon momentum and AdamW moments" if cfg.optimizer.uses_muon else "SGD momentum")
        notes.append(f"optimizer state not read: {why}; fresh {fresh}")
    if not (stateful or counts):
        return notes
    found = progress_of(reader.common)
    if not reader.common:
        notes.append("no common.pt (Megatron's iteration, sample counts, LR schedule and loss scale): "
                     "training restarts its schedule at iteration 0 on these weights")  # fmt: skip
    progress = state.progress
    progress.iteration = found.get("iteration", 0)
    progress.consumed_samples = found.get("consumed_samples", 0)
    progress.consumed_valid_samples = found.get("consumed_valid_samples", 0)
    if not stateful:
        return notes
    state.lr_schedule.num_samples = found.get("lr_num_samples", progress.consumed_samples)
    if "lr_num_samples" not in found:
        notes.append("no opt_param_scheduler: the LR schedule resumes at the consumed samples")
    if note := follow_weight_decay(reader.common.get("opt_param_scheduler") or {}, cfg, state.lr_schedule):
        notes.append(note)
    scaler = found.get("loss_scale")
    if scaler:
        state.scaler.load_state_dict({
            "kind": state.scaler.kind, "scale": float(scaler["scale"]),
            "growth_tracker": int(scaler.get("growth_tracker", 0)), "hysteresis_tracker": int(scaler.get("hysteresis_tracker", 0)),
        })  # fmt: skip
    return notes


def _source(state: TrainState, name: str) -> str:
    """The stored name a live tensor reads: the tied head's copy reads the embedding."""
    return (tied_source(name) if state.tied else None) or name


def _load_optimizer_state(state: TrainState, reader: MegatronReader, step: float) -> None:
    """Every slot of the live optimizer state (AdamW's moments, Muon's momentum) from the
    checkpoint, and AdamW's step."""
    for part, optimizer in zip(state.model.parts, state.optimizer.optimizers):
        # On an optimizer without state this first creates it (torch's zero-lr step).
        live = get_optimizer_state_dict(part, optimizer, options=FLAT_OPTIM)
        targets = {}
        for key, value in live.items():
            if not key.startswith("state."):
                continue
            name, slot = key[len("state."):].rsplit(".", 1)
            if slot == "step":
                value.fill_(step)
            else:
                targets[key] = (_source(state, name), slot, value)
        read_into(reader, targets)
        set_optimizer_state_dict(part, optimizer, live, options=FLAT_OPTIM)


def load_megatron_model(directory: Path, cfg: ModelConfig, vocab_rows: int) -> GPT:
    """A plain one-device GPT with the Megatron checkpoint's weights (vocabulary: `vocab_rows`)."""
    model = GPT(cfg, vocab_rows)
    state = model.state_dict()
    wanted = {n: tuple(state[n].shape) for n in dtgpt_names(cfg)}
    reader = MegatronReader(directory)
    reader.check_architecture(cfg)
    with torch.no_grad():
        for name, value in reader.model(wanted, list(wanted)):
            state[name].copy_(value)
    return model
