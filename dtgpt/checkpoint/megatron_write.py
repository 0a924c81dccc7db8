"""Conversion between dtgpt checkpoints and Megatron-LM's torch_dist, one tensor at a time.

Both directions are a `dcp.save` whose state dict holds meta tensors (shapes and dtypes only: all
DCP needs to plan) and a planner that produces each tensor when DCP's writer asks for it, so a
conversion holds about one (stacked) tensor in memory, never the model. The key map, vocabulary
padding and reader live in dtgpt/checkpoint/megatron.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex

from dtgpt.checkpoint import export, layout
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.megatron import (
    BACKEND_FILE, COMMON_FILE, VOCAB_KEYS, MegatronReader, dtgpt_names, find, full_model_shapes, megatron_name,
    progress_of, resize_vocab,
)  # fmt: skip
from dtgpt.config import Config, padded_vocab_size, to_toml

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
"""Megatron's linear layers, each with an `_extra_state` object per layer (None for the local spec)."""


class StreamingPlanner(DefaultSavePlanner):
    """Plans on meta tensors; `produce(key)` makes each real tensor when the writer needs it."""

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__(flatten_state_dict=False)  # Megatron's keys are flat; its objects stay whole
        self._produce = produce

    def lookup_object(self, index: MetadataIndex):
        value = super().lookup_object(index)
        if isinstance(value, torch.Tensor) and value.is_meta:
            return self._produce(index.fqn)
        return value


def _save_streaming(state: dict, directory: Path, produce: Callable[[str], torch.Tensor]) -> None:
    """dcp.save of `state`, producing each tensor on demand. One file per tensor, written by one
    thread: DCP keeps a file's tensors alive until the file is complete, so one file per rank
    would hold the whole model."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(str(directory), single_file_per_rank=False, thread_count=1)
    with layout.single_process():
        dcp.save(state, storage_writer=writer, planner=StreamingPlanner(produce), no_dist=True)


def _read_stacked(directory: Path, keys: list[str], metadata) -> torch.Tensor:
    """Tensors of a DCP checkpoint stacked on a new leading dimension, each read straight into
    its slot (no second copy for the stack)."""
    entry = metadata.state_dict_metadata[keys[0]]
    out = torch.empty((len(keys), *entry.size), dtype=entry.properties.dtype)
    request = {key: out[i] for i, key in enumerate(keys)}
    with layout.single_process():
        dcp.load(request, checkpoint_id=str(directory), no_dist=True)
    return out


# -- dtgpt -> Megatron -------------------------------------------------------------------------


def to_megatron(src: Path, cfg: Config, out_root: str | Path, tp: int = 1) -> Path:
    """Write dtgpt checkpoint `src` as Megatron-LM's torch_dist iteration under out_root, its
    vocabulary padded as Megatron pads for tensor parallel size `tp`. Returns the directory."""
    metadata = layout.read_metadata(src)
    marker = layout.read_marker(src) if (src / layout.MARKER).is_file() else {}
    iteration = int(marker.get("iteration", 0))
    rows = padded_vocab_size(export.model_vocab_size(src), cfg.model.make_vocab_size_divisible_by * tp)
    groups: dict[str, list[str]] = {}
    for name in dtgpt_names(cfg.model):
        key = f"model.{name}"
        if key not in metadata.state_dict_metadata:
            raise CheckpointError(f"{src} has no model tensor {name}, which the config's model has")
        groups.setdefault(megatron_name(name)[0], []).append(key)
    state: dict[str, object] = {}
    for mkey, keys in groups.items():
        entry = metadata.state_dict_metadata[keys[0]]
        shape = tuple(entry.size)
        if mkey.startswith("decoder.layers."):
            shape = (len(keys), *shape)
        elif _is_vocab(keys[0]):
            shape = (rows, *shape[1:])
        state[mkey] = torch.empty(shape, dtype=entry.properties.dtype, device="meta")
    L = cfg.model.num_layers
    for module in LINEAR_MODULES:
        for i in range(L):
            state[f"decoder.layers.{module}._extra_state/shard_{i}_{L}"] = [None]

    def produce(mkey: str) -> torch.Tensor:
        stacked = _read_stacked(src, groups[mkey], metadata)
        if mkey.startswith("decoder.layers."):
            return stacked
        return resize_vocab(stacked[0], rows) if _is_vocab(groups[mkey][0]) else stacked[0]

    directory = layout.iteration_dir(out_root, iteration)
    _save_streaming(state, directory, produce)
    progress = export.read_sections(src, ("train_state", "lr_schedule")) if _has(metadata, "train_state") else {}
    torch.save(_common(iteration, progress, cfg, tp, rows), directory / COMMON_FILE)
    (directory / BACKEND_FILE).write_text(json.dumps(BACKEND))
    layout.write_pointer(out_root, iteration)
    return directory


def _is_vocab(key: str) -> bool:
    return key.removeprefix("model.") in VOCAB_KEYS


def _has(metadata, section: str) -> bool:
    return any(k.startswith(section + ".") for k in metadata.state_dict_metadata)


def _common(iteration: int, progress: dict, cfg: Config, tp: int, rows: int) -> dict:
    """Megatron-LM's common.pt: where training stands, in its names."""
    consumed = int(progress.get("train_state", {}).get("consumed_samples", 0))
    m = cfg.model
    args = argparse.Namespace(
        consumed_train_samples=consumed, num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_size, padded_vocab_size=rows,
        tensor_model_parallel_size=tp, untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
    )  # fmt: skip
    common = {"iteration": iteration, "checkpoint_version": 3.0, "args": args}
    if "lr_schedule" in progress:
        common["opt_param_scheduler"] = {"num_steps": int(progress["lr_schedule"]["num_samples"])}
    return common


# -- Megatron -> dtgpt -------------------------------------------------------------------------


def from_megatron(src: str | Path, cfg: Config, out_root: str | Path, vocab_rows: int) -> Path:
    """Write Megatron checkpoint `src` (torch_dist or per-rank) as a dtgpt checkpoint (weights,
    iteration and consumed samples) for the model of `cfg` with `vocab_rows` rows."""
    directory = find(src)
    if directory is None:
        raise CheckpointError(f"{src} holds no Megatron checkpoint (no {BACKEND_FILE} or mp_rank_* directories)")
    reader = MegatronReader(directory)
    full = _model_shapes(cfg, vocab_rows)
    reader.check(full, list(full))
    names = sorted(full, key=megatron_name)  # each Megatron tensor is read once
    state = {f"model.{n}": torch.empty(full[n], device="meta") for n in names}
    found = progress_of(reader.common)
    iteration = found.get("iteration", 0)
    out = layout.iteration_dir(out_root, iteration)
    _save_streaming(state, out, lambda key: reader.tensor(key.removeprefix("model."), full[key.removeprefix("model.")]))
    tied = not cfg.model.untie_embeddings_and_output_weights
    layout.write_atomic(out / layout.CONFIG, to_toml(cfg))
    layout.write_marker(out, {
        "format": "dtgpt-dcp-1", "iteration": iteration, "consumed_samples": found.get("consumed_samples", 0),
        "mesh": None, "tied": tied, "converted_from": str(directory),
    })  # fmt: skip
    layout.write_pointer(out_root, iteration)
    return out


def _model_shapes(cfg: Config, vocab_rows: int) -> dict[str, tuple[int, ...]]:
    shapes = full_model_shapes(cfg.model)
    return {n: ((vocab_rows, *s[1:]) if n in VOCAB_KEYS else s) for n, s in shapes.items()}

