"""Conversion between dtgpt checkpoints and Megatron-LM's torch_dist, one tensor at a time.

Both directions are a `dcp.save` whose state dict holds meta tensors (shapes and dtypes only: all
DCP needs to plan) and a planner that produces each tensor when DCP's writer asks for it, so a
conversion holds about one (stacked) tensor in memory, never the model. The key map and vocabulary
padding live in keys.py, the reader in reader.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dtgpt.checkpoint import export, layout
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.architecture import megatron_args
from dtgpt.checkpoint.megatron.formats import BACKEND_FILE, COMMON_FILE, find, progress_of
from dtgpt.checkpoint.megatron.keys import (
    MTP_PREFIX, OPTIMIZER_PREFIX, VOCAB_KEYS, block_of, dtgpt_names, full_model_shapes, half_of, is_buffer, megatron_name,
    resize_vocab, stored_alias, stores_per_layer,
)  # fmt: skip
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.checkpoint.megatron.scheduler import scheduler_state
from dtgpt.checkpoint.megatron.write_muon import megatron_muon_common, muon_sources
from dtgpt.checkpoint.stored import stored_optimizer
from dtgpt.checkpoint.tokenizer_args import megatron_tokenizer_args
from dtgpt.config import Config, ModelConfig, OptimizerConfig, padded_vocab_size, to_toml
from dtgpt.config.decoupled_lr_rules import embedding_output_bounds

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
ATTENTION_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj")
MLA_LINEARS = ("self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj", "self_attention.linear_proj")
QUERY_LINEARS = {False: ("self_attention.linear_q_proj",), True: ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj")}
"""Multi-latent attention's query linears, without and with a compressed query (q_lora_rank)."""
MLP_LINEARS = ("mlp.linear_fc1", "mlp.linear_fc2")
SHARED_EXPERT_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_LINEARS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")


def _block_linears(cfg: ModelConfig, moe: bool) -> tuple[str, ...]:
    """A block's linear layers but the routed experts', as megatron-core names them."""
    linears = ATTENTION_LINEARS
    if cfg.multi_latent_attention:
        linears = QUERY_LINEARS[cfg.q_lora_rank is not None] + MLA_LINEARS
    if moe:
        return linears + (SHARED_EXPERT_LINEARS if cfg.moe_shared_expert_intermediate_size else ())
    return linears + MLP_LINEARS


def extra_state_keys(cfg: ModelConfig) -> list[str]:
    """The `_extra_state` objects megatron-core's loader asks for (None for the local spec): one
    per linear layer and layer, and per routed expert too. Stacked layers name each shard by its
    layer (`<layer>.<expert>` for an expert); a layer kept apart (and an MTP block) by its expert
    alone, else 0 of 1."""
    L, E = cfg.num_layers, cfg.num_experts

    def block(prefix: str, moe: bool, layer: int | None = None) -> list[str]:
        whole = "0_1" if layer is None else f"{layer}_{L}"
        keys = [f"{prefix}{module}._extra_state/shard_{whole}" for module in _block_linears(cfg, moe)]
        if moe:
            expert = (lambda e: f"{e}_{E}") if layer is None else (lambda e: f"{layer}.{e}_{L}.{E}")
            keys += [f"{prefix}{module}._extra_state/shard_{expert(e)}" for module in EXPERT_LINEARS for e in range(E)]
        return keys

    if stores_per_layer(cfg):
        keys = [key for i in range(L) for key in block(f"decoder.layers.{i}.", cfg.is_moe_layer(i))]
    else:  # every layer alike, stacked
        keys = [key for i in range(L) for key in block("decoder.layers.", cfg.moe_enabled, i)]
    for depth in range(cfg.mtp_depth):
        prefix = f"{MTP_PREFIX}{depth}."
        keys += [f"{prefix}eh_proj._extra_state/shard_0_1", *block(prefix + "transformer_layer.", cfg.is_moe_layer(L - 1))]
    return keys


class StreamingPlanner(DefaultSavePlanner):
    """Plans on meta tensors; `produce(key, layer)` makes each real tensor when the writer needs
    it. A tensor whose layers are stacked on dim 0 (a key in `stacked`) is written as one chunk
    per layer, as Megatron-LM stores it: `produce` makes one layer, (1, ...), at a time, and a
    reader of one layer reads one chunk."""

    def __init__(self, produce: Callable[[str, int | None], torch.Tensor], stacked: frozenset[str] = frozenset()):
        super().__init__(flatten_state_dict=False)  # Megatron's keys are flat; its objects stay whole
        self._produce, self._stacked = produce, stacked

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            if item.index.fqn not in self._stacked:
                items.append(item)
                continue
            size = item.tensor_data.size
            for layer in range(size[0]):
                offsets = torch.Size((layer,) + (0,) * (len(size) - 1))
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((1, *size[1:])))
                data = TensorWriteData(chunk=chunk, properties=item.tensor_data.properties, size=size)
                items.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD, tensor_data=data))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self._stacked:
            return self._produce(index.fqn, index.offset[0])
        value = super().lookup_object(index)
        if isinstance(value, torch.Tensor) and value.is_meta:
            return self._produce(index.fqn, None)
        return value


def _save_streaming(state: dict, directory: Path, produce: Callable[[str, int | None], torch.Tensor],
                    stacked: frozenset[str] = frozenset()) -> None:  # fmt: skip
    """dcp.save of `state`, producing each tensor (or layer of a `stacked` one) on demand. One
    file per chunk, written by one thread: DCP keeps a file's tensors alive until the file is
    complete, so one file per rank would hold the whole model."""
    fresh = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(str(directory), single_file_per_rank=False, thread_count=1)
    try:
        with layout.single_process():
            dcp.save(state, storage_writer=writer, planner=StreamingPlanner(produce, stacked), no_dist=True)
    except BaseException as e:  # CheckpointException is one, wrapping what a tensor's producer raised
        if fresh:  # ours, half-written: it would block the rerun
            shutil.rmtree(directory, ignore_errors=True)
        if isinstance(e, CheckpointException):
            raise _said_error(e, directory) from None
        raise


def _said_error(error: CheckpointException, directory: Path) -> CheckpointError:
    """The producer's own CheckpointError (a damaged or mismatched Megatron file, read only when
    its tensors are written), else DCP's failure in one line."""
    for failure in error.failures.values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, CheckpointError):
            return cause
    return CheckpointError(f"writing {directory} failed: {layout.describe(error)}")


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
    vocabulary padded as Megatron pads for tensor parallel size `tp`, with its Adam state (when
    it has one) as megatron-core's distributed optimizer stores it in model space, a Muon run's as
    megatron-core's Muon chain does (write_muon.py); an SGD run's momentum is not written yet.
    Returns the directory."""
    metadata = layout.read_metadata(src)
    marker = layout.read_marker(src) if (src / layout.MARKER).is_file() else {}
    iteration = int(marker.get("iteration", 0))
    export.refuse_run_root(out_root)  # never replace a save or move a run's pointer
    rows = padded_vocab_size(export.model_vocab_size(src), cfg.model.make_vocab_size_divisible_by * tp)
    kind = stored_optimizer(metadata)
    adam, muon = kind == "adam", kind == "muon"  # SGD momentum is left out (the docstring)
    stored = set(metadata.state_dict_metadata)
    # Megatron key -> per layer (one entry if not stacked), the dtgpt keys its rows concatenate
    # (two for SwiGLU's linear_fc1, [gate; fc1]; else one)
    sources: dict[str, dict[int | None, list[str]]] = {}
    model_key: dict[str, str] = {}  # Megatron key -> the model tensor it is shaped as
    names = dtgpt_names(cfg.model)
    for name in sorted(names, key=lambda n: half_of(n, names) or 0):  # a gate before its fc1
        mkey, layer = written_name(name, cfg.model)
        slots = {mkey: f"model.{name}"}
        if (adam or muon) and not is_buffer(name):  # the fp32 master weights are dtgpt's parameters
            sources_of = muon_sources(name, stored, cfg.training.bf16) if muon else _adam_sources(name)
            slots |= {f"{OPTIMIZER_PREFIX}{slot}.{mkey}": key for slot, key in sources_of.items()}
        for key, dtgpt_key in slots.items():
            if dtgpt_key not in metadata.state_dict_metadata:
                raise CheckpointError(f"{src} has no {dtgpt_key}, which the config's model has")
            sources.setdefault(key, {}).setdefault(layer, []).append(dtgpt_key)
            model_key[key] = mkey
    state: dict[str, object] = {}
    for key, layers in sources.items():
        parts = next(iter(layers.values()))
        entry = metadata.state_dict_metadata[parts[0]]
        shape = (len(parts) * entry.size[0], *entry.size[1:])
        if None not in layers:  # stacked decoder layers
            shape = (len(layers), *shape)
        elif model_key[key] in MEGATRON_VOCAB_KEYS:
            shape = (rows, *shape[1:])
        state[key] = torch.empty(shape, dtype=entry.properties.dtype, device="meta")
    for key in extra_state_keys(cfg.model):
        state[key] = [None]

    def produce(key: str, layer: int | None) -> torch.Tensor:
        value = _read_stacked(src, sources[key][layer], metadata).flatten(0, 1)  # its parts' rows in turn
        if layer is not None:  # one layer of a stacked tensor, (1, ...)
            return value.unsqueeze(0)
        return resize_vocab(value, rows) if model_key[key] in MEGATRON_VOCAB_KEYS else value

    directory = layout.iteration_dir(out_root, iteration)
    stacked = frozenset(key for key, layers in sources.items() if None not in layers)
    _save_streaming(state, directory, produce, stacked)
    progress = export.read_sections(src, ("train_state", "lr_schedule")) if _has(metadata, "train_state") else {}
    common = trainer_common(iteration, progress, cfg, tp, rows)
    if adam or muon:
        common |= (megatron_muon_common if muon else megatron_optimizer_common)(cfg.optimizer, stored_adam_step(src, metadata))
    torch.save(common, directory / COMMON_FILE)
    (directory / BACKEND_FILE).write_text(json.dumps(BACKEND))
    layout.write_pointer(out_root, iteration)
    return directory


MEGATRON_VOCAB_KEYS = {megatron_name(name)[0] for name in VOCAB_KEYS}


def written_name(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """dtgpt FQN -> (the Megatron key to_megatron writes, layer or None), as Megatron-LM's default
    (Transformer Engine) layer spec names it: with multi-latent attention a dense block's pre-MLP
    norm is fused into linear_fc1 (`mlp.linear_fc1.layer_norm_weight`), an MoE block's a module of
    its own (`pre_mlp_layernorm.weight`)."""
    key, layer = megatron_name(name, cfg.multi_latent_attention, stores_per_layer(cfg))
    block = block_of(name, cfg.num_layers)
    if cfg.multi_latent_attention and ".pre_mlp_layernorm." in key and not cfg.is_moe_layer(block):
        key = stored_alias(key)
    return key, layer


def _adam_sources(name: str) -> dict[str, str]:
    """Megatron optimizer slot -> the dtgpt checkpoint key it is written from."""
    return {"param": f"model.{name}", "exp_avg": f"optimizer.state.{name}.exp_avg", "exp_avg_sq": f"optimizer.state.{name}.exp_avg_sq"}


def stored_adam_step(src: Path, metadata) -> float:
    """AdamW's step count (every parameter has the same; the first one's is read)."""
    key = next(k for k in metadata.state_dict_metadata if k.startswith("optimizer.state.") and k.endswith(".step"))
    return float(_read_stacked(src, [key], metadata)[0])


def megatron_optimizer_common(cfg: OptimizerConfig, step: float) -> dict:
    """What megatron-core's distributed optimizer keeps in common.pt for the model-space
    (`fully_reshardable`) layout: its param groups (weight decay on matrices, none on biases and
    norms, told apart by wd_mult; under decoupled_lr the word embedding and output layer's between
    them, told apart by max_lr and min_lr, where megatron-core puts it) with the Adam step, and the
    sharding type, which Megatron-LM reads back from `content_metadata`."""
    bounds = [(1.0, cfg.lr, cfg.min_lr, True)]
    if cfg.decoupled_lr is not None:
        bounds.append((1.0, *embedding_output_bounds(cfg), False))
    bounds.append((0.0, cfg.lr, cfg.min_lr, True))
    groups = [
        {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, "default_config": default,
         "max_lr": max_lr, "min_lr": min_lr, "lr": max_lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
         "weight_decay": cfg.weight_decay * wd_mult, "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
         "differentiable": False, "fused": None, "decoupled_weight_decay": True, "step": step}
        for wd_mult, max_lr, min_lr, default in bounds
    ]  # fmt: skip
    sharding = "fully_reshardable"
    return {"optimizer": {"optimizer": {"param_groups": groups}, "param_state_sharding_type": sharding},
            "content_metadata": {"distrib_optim_sharding_type": sharding}}  # fmt: skip


def _has(metadata, section: str) -> bool:
    return any(k.startswith(section + ".") for k in metadata.state_dict_metadata)


def trainer_common(iteration: int, progress: dict, cfg: Config, tp: int, rows: int) -> dict:
    """Megatron-LM's common.pt: where training stands, in its names."""
    train_state = progress.get("train_state", {})
    consumed, consumed_valid = (int(train_state.get(key, 0)) for key in ("consumed_samples", "consumed_valid_samples"))
    m = cfg.model
    args = argparse.Namespace(
        consumed_train_samples=consumed, consumed_valid_samples=consumed_valid, padded_vocab_size=rows,
        tensor_model_parallel_size=tp, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, **megatron_args(m),
        **megatron_tokenizer_args(cfg.data),
    )  # fmt: skip
    common = {"iteration": iteration, "checkpoint_version": 3.0, "args": args}
    if "lr_schedule" in progress:
        common["opt_param_scheduler"] = scheduler_state(cfg, int(progress["lr_schedule"]["num_samples"]))
    return common


# -- Megatron -> dtgpt -------------------------------------------------------------------------


def from_megatron(src: str | Path, cfg: Config, out_root: str | Path, vocab_rows: int) -> Path:
    """Write Megatron checkpoint `src` (torch_dist or per-rank) as a dtgpt checkpoint (weights,
    iteration and consumed samples) for the model of `cfg` with `vocab_rows` rows."""
    directory = find(src)
    if directory is None:
        raise CheckpointError(f"{src} holds no Megatron checkpoint (no {BACKEND_FILE} or mp_rank_* directories)")
    export.refuse_run_root(out_root)
    reader = MegatronReader(directory)
    reader.check_architecture(cfg.model)
    full = full_model_shapes(cfg.model, vocab_rows)
    reader.check(full, list(full))
    names = sorted(full, key=megatron_name)  # each Megatron tensor is read once
    state = {f"model.{n}": torch.empty(full[n], device="meta") for n in names}
    found = progress_of(reader.common)
    iteration = found.get("iteration", 0)
    out = layout.iteration_dir(out_root, iteration)
    def produce(key: str, _) -> torch.Tensor:
        name = key.removeprefix("model.")
        tensor = reader.tensor(name, full[name])
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # as a load refuses it (manager.py)
            key, layer = written_name(name, cfg.model)
            where = key if layer is None else f"{key} (layer {layer})"
            raise CheckpointError(f"Megatron checkpoint {directory}: {where} holds non-finite values (NaN or inf): a damaged file?")
        return tensor

    _save_streaming(state, out, produce)  # refuse_run_root found no iter_* there: a failed one is removed
    tied = not cfg.model.untie_embeddings_and_output_weights
    layout.write_atomic(out / layout.CONFIG, to_toml(cfg))
    layout.write_marker(out, {
        "format": "dtgpt-dcp-1", "iteration": iteration, "consumed_samples": found.get("consumed_samples", 0),
        "mesh": None, "tied": tied, "converted_from": str(directory),
    })  # fmt: skip
    layout.write_pointer(out_root, iteration)
    return out
