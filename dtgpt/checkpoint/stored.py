"""What a training checkpoint holds, as DCP state dicts whose keys never mention the mesh (the
RNG states aside: they belong to a (pp, tp) coordinate).

    model.<fqn>                         parameters (DTensor shards are resharded by DCP)
    optimizer.state.<fqn>.<name>        the optimizer's state, flattened by FQN: AdamW's exp_avg,
                                        exp_avg_sq, step; SGD's momentum_buffer (none without momentum)
    train_state.* lr_schedule.* loss_scaler.*   the Stateful objects' dicts, as tensors
                                        (dtgpt.state.scalars_to_tensors): no item is a pickle
    rng.pp_<p>.tp_<t>.cpu / .cuda / .model_parallel
                                        the generator states of the ranks at pipeline rank p and
                                        tensor rank t (dp and cp peers hold equal ones: stored
                                        once; dtgpt.state.rng_state); a load at another pp, tp
                                        or schedule re-derives them from training.seed instead

FQNs are the whole model's names on every pipeline stage (blocks keep their global ModuleDict
keys), so any mesh reads any other mesh's checkpoint. With a tied embedding, the last stage's own
copy of the word embedding (`output.weight`, and its optimizer state) is not saved: it is always
equal to `embedding.word.weight` (dtgpt.parallel.tied), which is stored once and read into both.
The optimizer's hyperparameters (param_groups) are not saved: the resumed run's config wins.
The dict itself is dtgpt.state.TrainState.state_dict(); this module checks a stored one against it.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from dtgpt.config.muon_keys import MUON_OPTIMIZERS


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


def stored_items(request: dict, sections, metadata: Metadata) -> dict:
    """The load request with only the items of `sections` that the checkpoint holds: a counter
    added since it was saved (train_state.consumed_valid_samples) is left at its default."""
    saved = metadata.state_dict_metadata
    kept = {s: {k: v for k, v in request[s].items() if f"{s}.{k}" in saved} for s in sections if s in request}
    return {**request, **kept}


OPTIMIZER_SLOTS = {"exp_avg": "adam", "exp_avg_sq": "adam", "momentum_buffer": "sgd"}
"""The state each optimizer.optimizer keeps per parameter (its `step` aside), by name. Muon keeps
both kinds: a momentum_buffer for its matrices, AdamW's moments for the rest (dtgpt/muon.py)."""


def stored_optimizer(metadata: Metadata) -> str | None:
    """The optimizer whose state a checkpoint holds ('adam', 'sgd' or 'muon'); None when it holds none."""
    kinds = {OPTIMIZER_SLOTS.get(key.rsplit(".", 1)[1]) for key in metadata.state_dict_metadata if key.startswith("optimizer.state.")}
    kinds.discard(None)
    return "muon" if len(kinds) > 1 else next(iter(kinds), None)


def optimizer_problem(request: dict[str, object], metadata: Metadata, optimizer: str) -> str | None:
    """The first problem of loading the optimizer state `request` (the optimizer section, flat),
    as one line: the state of another optimizer than `optimizer` (optimizer.optimizer: AdamW's
    moments are no SGD momentum, Muon's are both, none resumes another), or a requested tensor missing or reshaped."""
    stored = stored_optimizer(metadata)
    optimizer = "muon" if optimizer in MUON_OPTIMIZERS else optimizer  # dist_muon is muon
    if stored is None or stored == optimizer:
        return shape_problem(flat_keys("optimizer", request), metadata, "optimizer")
    return (
        f"its optimizer state is {stored}'s, and optimizer.optimizer={optimizer!r}: one optimizer's state does not "
        f"resume another; set optimizer.optimizer={stored!r} to resume it, or checkpoint.load_optimizer=false to "
        f"start {optimizer} fresh on its weights"
    )
