"""Megatron-LM GPT checkpoints in and out: format detection, the key map, readers and a writer.

Two formats, both under Megatron's `iter_XXXXXXX/` + `latest_checkpointed_iteration.txt`:

    torch_dist   iter_N/metadata.json ({"sharded_backend": "torch_dist"}), common.pt, .metadata and
                 __<rank>_<n>.distcp: DCP underneath, mesh-free keys, the layers stacked on a
                 leading dimension (decoder.layers.self_attention.linear_qkv.weight is (L, 3h, h))
    per-rank     iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt: one torch.save dict per model-parallel
                 rank, per-layer keys numbered within the stage, split by TP rank

Both become dtgpt's full tensors by name (`model.<fqn>`); the Checkpointer then copies each
rank's slice into its (possibly sharded) parameters, so a Megatron checkpoint loads at any mesh.
QKV rows need no reordering: Megatron interleaves them per query group, [q | k | v] of each
group, which with one head per group (dtgpt has no GQA) is dtgpt's head-by-head layout.
The vocabulary rows are Megatron's padding (make_vocab_size_divisible_by x tp): rows are dropped
or zero-padded to the model's, never rows of real tokens (the tokenizer fits both).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.regions import read_regions
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.config import ModelConfig
from dtgpt.model import GPT

BACKEND_FILE = "metadata.json"
COMMON_FILE = "common.pt"
PER_RANK_FILE = "model_optim_rng.pt"
OPTIMIZER_PREFIX = "optimizer.state."
"""Megatron's model-space optimizer state: `optimizer.state.<slot>.<model key>`, shaped as the model key."""
_PER_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")

GLOBAL_KEYS = {
    "embedding.word.weight": "embedding.word_embeddings.weight",
    "embedding.position.weight": "embedding.position_embeddings.weight",
    "norm.weight": "decoder.final_layernorm.weight",
    "norm.bias": "decoder.final_layernorm.bias",
    "output.weight": "output_layer.weight",
}
"""dtgpt name -> Megatron name of the tensors outside the blocks."""

LAYER_KEYS = {
    "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_norm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "attention.qkv.weight": "self_attention.linear_qkv.weight",
    "attention.qkv.bias": "self_attention.linear_qkv.bias",
    "attention.proj.weight": "self_attention.linear_proj.weight",
    "attention.proj.bias": "self_attention.linear_proj.bias",
    "mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp_norm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.fc1.weight": "mlp.linear_fc1.weight",
    "mlp.fc1.bias": "mlp.linear_fc1.bias",
    "mlp.fc2.weight": "mlp.linear_fc2.weight",
    "mlp.fc2.bias": "mlp.linear_fc2.bias",
}
"""dtgpt block-relative name -> Megatron's (torch_dist stacks it under `decoder.layers.`)."""

LOCAL_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
"""The same norms under the local layer spec's per-layer names (the per-rank format keeps them)."""

VOCAB_KEYS = ("embedding.word.weight", "output.weight")
_TP_DIM = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_fc1.bias": 0,
           "word_embeddings.weight": 0, "output_layer.weight": 0, "linear_proj.weight": 1, "linear_fc2.weight": 1}  # fmt: skip
"""How the per-rank format splits a tensor over TP ranks (column parallel: rows; row parallel:
columns); anything not named is replicated."""

SAFE_GLOBALS = [argparse.Namespace]
"""What Megatron's pickles hold besides tensors and plain containers (its `args`)."""


# -- where and what --------------------------------------------------------------------------


def is_torch_dist(directory: Path) -> bool:
    try:
        return json.loads((directory / BACKEND_FILE).read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def per_rank_dirs(directory: Path) -> dict[tuple[int, int], Path]:
    """(tp_rank, pp_rank) -> mp_rank_TT[_PPP] directory holding model_optim_rng.pt."""
    found = {}
    for sub in directory.iterdir() if directory.is_dir() else ():
        match = _PER_RANK_DIR.match(sub.name)
        if match and (sub / PER_RANK_FILE).is_file():
            found[(int(match.group(1)), int(match.group(2) or 0))] = sub
    return found


def is_megatron_dir(directory: Path) -> bool:
    return is_torch_dist(directory) or bool(per_rank_dirs(directory))


def find(root: str | Path, iteration: int = 0) -> Path | None:
    """The Megatron iteration directory `root` names (itself, its pointer's, or `iteration`),
    or None when `root` holds no Megatron checkpoint (then it is dtgpt's, or nothing)."""
    root = Path(root)
    if is_megatron_dir(root):
        return root
    pointed = iteration or layout.read_pointer(root)
    if pointed is None:
        return None
    directory = layout.iteration_dir(root, pointed)
    return directory if is_megatron_dir(directory) else None


def load_pickle(path: Path) -> dict:
    """A Megatron pickle, unpickled with only tensors, containers and argparse.Namespace allowed."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure reads the same to the user
        raise CheckpointError(f"{path}: cannot be read as a Megatron checkpoint file: {e}") from None


def megatron_name(name: str) -> tuple[str, int | None]:
    """dtgpt FQN -> (Megatron torch_dist key, layer index or None)."""
    if name in GLOBAL_KEYS:
        return GLOBAL_KEYS[name], None
    _, layer, rest = name.split(".", 2)  # layers.<i>.<rest>
    return "decoder.layers." + LAYER_KEYS[rest], int(layer)


def dtgpt_names(cfg: ModelConfig) -> list[str]:
    """Every dtgpt FQN of the full model of `cfg` (a tied head's copy left out: it is the embedding)."""
    num_layers, tied = cfg.num_layers, not cfg.untie_embeddings_and_output_weights
    learned_positions = cfg.position_embedding_type == "learned_absolute"
    names = ["embedding.word.weight"] + (["embedding.position.weight"] if learned_positions else [])
    names += [f"layers.{i}.{rest}" for i in range(num_layers) for rest in LAYER_KEYS]
    names += ["norm.weight", "norm.bias"] + ([] if tied else ["output.weight"])
    if cfg.normalization == "RMSNorm":
        names = [n for n in names if not n.endswith("norm.bias")]
    return names


def resize_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Drop or zero-pad padding rows of a vocabulary-sized tensor to `rows`."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def _mismatch(directory: Path, key: str, stored, wanted, name: str) -> CheckpointError:
    return CheckpointError(
        f"Megatron checkpoint {directory} does not fit this model: {key} has shape {tuple(stored)} in the "
        f"checkpoint but this model's {name} needs {tuple(wanted)}"
    )


# -- reading ---------------------------------------------------------------------------------


class MegatronReader:
    """Full dtgpt tensors by name from a Megatron checkpoint, one Megatron tensor read at a time."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.torch_dist = is_torch_dist(directory)
        if self.torch_dist:
            # Megatron keeps each layer's Transformer Engine state as a pickled `_extra_state`, and
            # the distributed optimizer's dp_reshardable layout pickled objects: dtgpt never reads them.
            metadata = layout.read_metadata(directory, unread=lambda key: "._extra_state" in key or key.startswith("optimizer."))
            self.shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                           if isinstance(v, TensorStorageMetadata)}  # fmt: skip
            self.dtypes = {k: v.properties.dtype for k, v in metadata.state_dict_metadata.items()
                           if isinstance(v, TensorStorageMetadata)}  # fmt: skip
            common = directory / COMMON_FILE
            self.common = load_pickle(common) if common.is_file() else {}
        else:
            self._per_rank = PerRankModel(directory)
            self.common = self._per_rank.common
            self.shapes = self._per_rank.stacked_shapes()
            self.dtypes = {}

    @property
    def num_layers(self) -> int:
        return self.shapes["decoder.layers.self_attention.linear_qkv.weight"][0]

    def check(self, wanted: dict[str, tuple[int, ...]], model_names: list[str]) -> None:
        """One clear error for the first tensor whose shape (or presence) differs; vocabulary rows
        may differ (padding is reconciled). `wanted` may be one stage's share of the model whose
        names are `model_names`."""
        num_layers = sum(1 for n in model_names if n.endswith("attention.qkv.weight"))
        if self.num_layers != num_layers:
            key = "decoder.layers.self_attention.linear_qkv.weight"
            raise CheckpointError(
                f"Megatron checkpoint {self.directory} does not fit this model: {key} stacks {self.num_layers} layers "
                f"{self.shapes[key]} but model.num_layers={num_layers}"
            )
        used = {megatron_name(n)[0] for n in model_names}
        for name, shape in wanted.items():
            key, layer = megatron_name(name)
            if key not in self.shapes:
                hint = " (the model's head is untied; is the checkpoint's tied?)" if name == "output.weight" else ""
                raise CheckpointError(
                    f"Megatron checkpoint {self.directory} has no {key}, which this model's {name} {tuple(shape)} needs{hint}"
                )
            stored = self.shapes[key]
            if layer is not None:
                stored = stored[1:]
            if name in VOCAB_KEYS:
                stored, shape = stored[1:], tuple(shape)[1:]
            if tuple(stored) != tuple(shape):
                raise _mismatch(self.directory, key, self.shapes[key], wanted[name], name)
        for key, shape in self.shapes.items():
            if key not in used and not key.endswith("_extra_state") and self._is_model_key(key):
                raise CheckpointError(
                    f"Megatron checkpoint {self.directory}: its tensor {key} {tuple(shape)} has no counterpart in this model"
                )

    @staticmethod
    def _is_model_key(key: str) -> bool:
        return key.startswith(("embedding.", "decoder.", "output_layer."))

    def stored_key(self, name: str, slot: str | None = None) -> str:
        """The Megatron key of dtgpt tensor `name`, or of its optimizer state `slot` (exp_avg, ...)."""
        key = megatron_name(name)[0]
        return key if slot is None else f"{OPTIMIZER_PREFIX}{slot}.{key}"

    def regions(self, wanted: dict[str, tuple[str, str | None, tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """Sub-regions of dtgpt tensors: request -> (dtgpt name, optimizer slot or None, offsets,
        sizes) in dtgpt's coordinates. Only the stored chunks that overlap a region are read
        (one layer of a stacked tensor, one shard's rows), in one DCP load; vocabulary rows past
        the stored ones are zeros."""
        out, dcp_requests = {}, {}
        for request, (name, slot, offsets, sizes) in wanted.items():
            layer = megatron_name(name)[1]
            key = self.stored_key(name, slot)
            out[request] = torch.zeros(sizes, dtype=self.dtypes.get(key, torch.float32))
            rows = sizes[0] if sizes else 0
            if name in VOCAB_KEYS:  # the stored padding may be shorter or longer than ours
                rows = max(0, min(offsets[0] + sizes[0], self.shapes[key][0]) - offsets[0])
            if sizes and rows == 0:
                continue
            target = out[request][:rows] if sizes else out[request]
            at = tuple(offsets) if layer is None else (layer, *offsets)
            target_at = target if layer is None else target.unsqueeze(0)
            if self.torch_dist:
                dcp_requests[request] = (key, at, target_at)
            else:
                stored = self._per_rank.stacked(key)
                for dim, (start, size) in enumerate(zip(at, target_at.shape)):
                    stored = stored.narrow(dim, start, size)
                target_at.copy_(stored)
        if dcp_requests:
            read_regions(self.directory, dcp_requests)
        return out

    def tensor(self, name: str, shape: tuple[int, ...], slot: str | None = None) -> torch.Tensor:
        """dtgpt tensor `name` (or its optimizer state `slot`), full, with the vocabulary rows
        reconciled to `shape`."""
        return self.regions({name: (name, slot, (0,) * len(shape), tuple(shape))})[name]

    def model(self, wanted: dict[str, tuple[int, ...]], model_names: list[str]):
        """(name, full tensor) for every wanted name, one layer's tensor read at a time."""
        self.check(wanted, model_names)
        for name in sorted(wanted, key=lambda n: megatron_name(n)):
            yield name, self.tensor(name, tuple(wanted[name]))


class PerRankModel:
    """Megatron-LM's per-rank format, glued back into torch_dist's stacked, full tensors."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = per_rank_dirs(directory)
        self.tp = 1 + max(t for t, _ in self.files)
        self.pp = 1 + max(p for _, p in self.files)
        self._models: dict[tuple[int, int], dict] = {}
        self._last: tuple[str, torch.Tensor] | None = None
        self.common = {k: v for k, v in self._load(0, 0).items() if k != "model"}
        self.common.pop("optimizer", None)

    def _load(self, tp: int, pp: int) -> dict:
        if (tp, pp) not in self._models:
            self._models[(tp, pp)] = load_pickle(self.files[(tp, pp)] / PER_RANK_FILE)
        return self._models[(tp, pp)]

    def _model(self, tp: int, pp: int) -> dict:
        return self._load(tp, pp)["model"]

    def _layer_count(self, pp: int) -> int:
        suffix = ".self_attention.linear_qkv.weight"
        return sum(1 for k in self._model(0, pp) if k.startswith("decoder.layers.") and k.endswith(suffix))

    def _stored_name(self, model: dict, layer: int, rest: str) -> str:
        name = f"decoder.layers.{layer}.{rest}"
        return name if name in model or rest not in LOCAL_NORM_NAMES else f"decoder.layers.{layer}.{LOCAL_NORM_NAMES[rest]}"

    def _join_tp(self, key_of_rank, key: str) -> torch.Tensor:
        parts = [key_of_rank(tp) for tp in range(self.tp)]
        dim = next((d for suffix, d in _TP_DIM.items() if key.endswith(suffix)), None)
        return parts[0] if dim is None else torch.cat(parts, dim)

    def stacked(self, key: str) -> torch.Tensor:
        """One stacked tensor, glued from every rank's file (the last one is kept: a reader asks
        for it once per layer)."""
        if self._last is None or self._last[0] != key:
            self._last = (key, self._glue(key))
        return self._last[1]

    def _glue(self, key: str) -> torch.Tensor:
        if not key.startswith("decoder.layers."):
            pp = self.pp - 1 if key.startswith(("decoder.final", "output_layer")) else 0
            return self._join_tp(lambda tp: self._model(tp, pp)[key], key)
        rest = key[len("decoder.layers."):]
        layers = []
        for pp in range(self.pp):
            for i in range(self._layer_count(pp)):
                layers.append(self._join_tp(lambda tp: self._model(tp, pp)[self._stored_name(self._model(tp, pp), i, rest)], key))
        return torch.stack(layers)

    def stacked_shapes(self) -> dict[str, tuple[int, ...]]:
        keys = set(GLOBAL_KEYS.values()) | {"decoder.layers." + k for k in LAYER_KEYS.values()}
        shapes = {}
        for key in keys:
            try:
                shapes[key] = tuple(self._glue(key).shape)
            except KeyError:
                continue  # not in this checkpoint (tied head, no learned positions, no bias)
        return shapes


# -- progress ----------------------------------------------------------------------------------


def progress_of(common: dict) -> dict:
    """What a Megatron-LM trainer stores about where it stands: iteration, consumed samples, the
    LR schedule's sample count and the loss scale, each only when present."""
    out = {}
    if "iteration" in common:
        out["iteration"] = int(common["iteration"])
    args = common.get("args")
    if args is not None and getattr(args, "consumed_train_samples", None) is not None:
        out["consumed_samples"] = int(args.consumed_train_samples)
    scheduler = common.get("opt_param_scheduler") or {}
    if "num_steps" in scheduler:
        out["lr_num_samples"] = int(scheduler["num_steps"])
    scaler = _grad_scaler(common.get("optimizer"))
    if scaler:
        out["loss_scale"] = scaler
    return out


def _grad_scaler(optimizer) -> dict | None:
    """Megatron's grad_scaler dict ({scale, growth_tracker, hysteresis_tracker}) where its
    optimizer state keeps it: at the top, or one level down (chained optimizers: a list or dict)."""
    if isinstance(optimizer, dict) and isinstance(optimizer.get("grad_scaler"), dict):
        return optimizer["grad_scaler"]
    inner = optimizer.values() if isinstance(optimizer, dict) else optimizer if isinstance(optimizer, list) else ()
    for value in inner:
        if isinstance(value, dict) and isinstance(value.get("grad_scaler"), dict):
            return value["grad_scaler"]
    return None


# -- into dtgpt --------------------------------------------------------------------------------


def load_model(directory: Path, cfg: ModelConfig, vocab_rows: int):
    """A plain one-device GPT with the Megatron checkpoint's weights (vocabulary: `vocab_rows`)."""
    model = GPT(cfg, vocab_rows)
    state = model.state_dict()
    wanted = {n: tuple(state[n].shape) for n in dtgpt_names(cfg)}
    with torch.no_grad():
        for name, value in MegatronReader(directory).model(wanted, list(wanted)):
            state[name].copy_(value)
    return model


def full_model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every dtgpt tensor's full shape (vocabulary rows aside: those are reconciled), on meta."""
    with torch.device("meta"):
        state = GPT(cfg, 1).state_dict()
    return {name: tuple(state[name].shape) for name in dtgpt_names(cfg)}
