"""What a training checkpoint holds, as DCP state dicts whose keys never mention the mesh.

    model.<fqn>                         parameters (DTensor shards are resharded by DCP)
    optimizer.state.<fqn>.<name>        AdamW state (exp_avg, exp_avg_sq, step), flattened by FQN
    train_state.* lr_schedule.* loss_scaler.*   the Stateful objects' dicts
    rng.rank_<r>.cpu / .cuda            each rank's generator state

FQNs are the whole model's names on every pipeline stage (blocks keep their global ModuleDict
keys), so any mesh reads any other mesh's checkpoint. With a tied embedding, the last stage's own
copy of the word embedding (`output.weight`, and its optimizer state) is not saved: it is always
equal to `embedding.word.weight` (dtgpt.parallel.tied), which is stored once and read into both.
The optimizer's hyperparameters (param_groups) are not saved: the resumed run's config wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from dtgpt.model import OUTPUT_WEIGHT, WORD_EMBEDDING

FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
STATEFUL_SECTIONS = ("train_state", "lr_schedule", "loss_scaler")


def tied_source(key: str) -> str | None:
    """For the last stage's copy of the tied weight (or its optimizer state): the key it loads from."""
    if key == OUTPUT_WEIGHT:
        return WORD_EMBEDDING
    prefix = f"state.{OUTPUT_WEIGHT}."
    if key.startswith(prefix):
        return f"state.{WORD_EMBEDDING}." + key[len(prefix):]
    return None


def _is_state_key(key: str) -> bool:
    return key.startswith("state.")


def model_dicts(parts: list) -> list[dict]:
    return [get_model_state_dict(part) for part in parts]


def optimizer_dicts(parts: list, optimizers: list) -> list[dict]:
    """Flattened optimizer state per part. Careful: on an optimizer with no state yet this runs
    a zero-lr step to create it (torch's way), so call it at save time only once a step happened."""
    return [get_optimizer_state_dict(part, opt, options=FLAT_OPTIM) for part, opt in zip(parts, optimizers)]


def _merge(dicts: list[dict], tied: bool, keep: Callable[[str], bool] = lambda k: True) -> dict:
    """One dict over all parts: keys are disjoint across stages except the tied copy, left out."""
    merged = {}
    for d in dicts:
        for key, value in d.items():
            if keep(key) and not (tied and tied_source(key)):
                merged[key] = value
    return merged


def rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    state = {f"rank_{rank}.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state[f"rank_{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(states: dict[str, torch.Tensor], rank: int, device: torch.device) -> None:
    torch.set_rng_state(states[f"rank_{rank}.cpu"])
    if device.type == "cuda" and f"rank_{rank}.cuda" in states:
        torch.cuda.set_rng_state(states[f"rank_{rank}.cuda"], device)


def save_state(trainer) -> dict:
    """The nested dict handed to dcp.save / dcp.async_save (values alias live tensors)."""
    parts, optimizers = trainer.model.parts, trainer.optimizer.optimizers
    tied = parts[0].tied
    state = {
        "model": _merge(model_dicts(parts), tied),
        "train_state": trainer.state.state_dict(),
        "lr_schedule": trainer.lr_schedule.state_dict(),
        "loss_scaler": trainer.scaler.state_dict(),
        "rng": rng_state(trainer.runtime.rank, trainer.runtime.device),
    }
    # Steps are skipped on every rank together, so either all optimizers have state or none.
    if all(opt.state for opt in optimizers):
        state["optimizer"] = _merge(optimizer_dicts(parts, optimizers), tied, keep=_is_state_key)
    return state


def flat_keys(section: str, d: dict) -> dict[str, object]:
    """DCP's flattened names of a two-level dict: {section: {k: v}} -> {"section.k": v}."""
    return {f"{section}.{key}": value for key, value in d.items()}


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape)  # a DTensor's shape is the global one


def shape_problem(request: dict[str, object], metadata: Metadata, what: str) -> str | None:
    """The first requested tensor that is missing from the checkpoint or differs in shape."""
    saved = metadata.state_dict_metadata
    for key, value in request.items():
        if not isinstance(value, torch.Tensor):
            continue
        name = key.split(".", 1)[1]
        if key not in saved:
            return f"{what} tensor {name} {_shape(value)} is not in the checkpoint"
        entry = saved[key]
        if not isinstance(entry, TensorStorageMetadata):
            return f"{what} entry {name} is not a tensor in the checkpoint"
        if tuple(entry.size) != _shape(value):
            return (
                f"{what} tensor {name} has shape {tuple(entry.size)} in the checkpoint "
                f"but {_shape(value)} in this model"
            )
    return None


def extra_problem(model_keys: set[str], metadata: Metadata) -> str | None:
    """The first checkpoint parameter that no rank of this model asked for (e.g. more layers)."""
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith("model.") and key not in model_keys:
            size = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "(not a tensor)"
            return f"checkpoint tensor {key.split('.', 1)[1]} {size} has no counterpart in this model"
    return None


def has_section(metadata: Metadata, section: str) -> bool:
    return any(key.startswith(section + ".") for key in metadata.state_dict_metadata)


@dataclass
class LoadTargets:
    """Where a load writes: per-part dicts (aliases of the live parameters and optimizer state),
    the flat request handed to dcp.load, and tied copies to fill in afterwards."""

    model: list[dict]
    optimizer: list[dict] | None
    request: dict[str, dict] = field(default_factory=dict)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add(self, section: str, dicts: list[dict], tied: bool, keep: Callable[[str], bool] = lambda k: True) -> None:
        request: dict = {}
        pending = []
        for d in dicts:
            for key, value in d.items():
                if not keep(key):
                    continue
                source = tied_source(key) if tied else None
                if source is None:
                    request[key] = value
                else:
                    pending.append((value, source))
        for value, source in pending:
            if source in request:  # this rank also holds the embedding: copy after loading
                self.copies.append((value, request[source]))
            else:  # read the stored embedding straight into the last stage's copy
                request[source] = value
        self.request[section] = request

    def flat(self, section: str) -> dict[str, object]:
        return flat_keys(section, self.request.get(section, {}))


def build_targets(parts: list, optimizers: list, load_optimizer: bool) -> LoadTargets:
    tied = parts[0].tied
    targets = LoadTargets(model=model_dicts(parts), optimizer=None)
    targets.add("model", targets.model, tied)
    if load_optimizer:
        targets.optimizer = optimizer_dicts(parts, optimizers)
        targets.add("optimizer", targets.optimizer, tied, keep=_is_state_key)
    return targets


@torch.no_grad()
def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if isinstance(dst, DTensor) and isinstance(src, DTensor):
        if dst.placements != src.placements or dst.to_local().shape != src.to_local().shape:
            raise RuntimeError(f"tied copies are laid out differently: {dst.placements} vs {src.placements}")
        dst, src = dst.to_local(), src.to_local()
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def apply_loaded(targets: LoadTargets, parts: list, optimizers: list) -> None:
    """After dcp.load filled the request: fill tied copies, hand the dicts to the modules/optimizers."""
    for dst, src in targets.copies:
        _copy(dst, src)
    for part, d in zip(parts, targets.model):
        set_model_state_dict(part, d)
    if targets.optimizer is not None:
        for part, opt, d in zip(parts, optimizers, targets.optimizer):
            set_optimizer_state_dict(part, opt, d, options=FLAT_OPTIM)
