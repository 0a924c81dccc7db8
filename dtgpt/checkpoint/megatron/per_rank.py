"""Megatron-LM's per-rank format (mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt), read as
torch_dist's stacked, full tensors (reader.py reads either format by dtgpt name).

Each (tp, pp, ep) rank's file holds its pipeline stage's layers, numbered within the stage, its
TP split of each tensor, and, in an MoE layer, only its expert-parallel rank's routed experts as
`mlp.experts.local_experts.<K>.`: ep rank r's expert K is the global expert r * E_local + K.
Everything outside the routed experts is the same in every ep rank's file (ep rank 0's is read).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, load_pickle, per_rank_dirs
from dtgpt.checkpoint.megatron.keys import EXPERT_KEY, GLOBAL_KEYS, LAYER_KEYS, LOCAL_NORM_NAMES

TP_DIM = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_fc1.bias": 0,
           "word_embeddings.weight": 0, "output_layer.weight": 0, "linear_proj.weight": 1, "linear_fc2.weight": 1}  # fmt: skip
"""How the per-rank format splits a tensor over TP ranks (column parallel: rows; row parallel:
columns); anything not named is replicated."""

LOCAL_EXPERTS = "mlp.experts.local_experts."
UNEVEN_SPLIT_ARGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
                     "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")  # fmt: skip
"""Megatron's args that make its pipeline split uneven: then each stage's file says its layer count."""


def _expert_parallel(saved: dict) -> bool:
    """Whether mp_rank_TT_NNN names ep ranks: a file's args say ep > 1 with pp 1."""
    args = saved.get("args")
    return getattr(args, "expert_model_parallel_size", 1) > 1 and getattr(args, "pipeline_model_parallel_size", 1) <= 1


class PerRankModel:
    """Megatron-LM's per-rank format, glued back into torch_dist's stacked, full tensors.

    A file holds its pp rank's model under `model`, or with virtual pipelining one chunk per
    virtual stage under `model0`, `model1`, ...: as in Megatron's interleaved layout, chunk v of
    pp rank r is pipeline stage v * pp + r. Layers are numbered within their chunk."""

    def __init__(self, directory: Path):
        self.directory = directory
        first_dir = min(per_rank_dirs(directory).values())  # mp_rank_00[_000[_000]]: rank 0's, whatever the names mean
        first = load_pickle(first_dir / PER_RANK_FILE, mmap=True)
        self.files = per_rank_dirs(directory, _expert_parallel(first))
        self.tp, self.pp, self.ep = (1 + max(rank[i] for rank in self.files) for i in range(3))
        missing = [rank for rank in itertools.product(range(self.tp), range(self.pp), range(self.ep)) if rank not in self.files]
        if missing:
            tp, pp, ep = missing[0]
            raise CheckpointError(
                f"Megatron checkpoint {directory}: the per-rank files of tp {self.tp} x pp {self.pp} x ep {self.ep} ranks "
                f"lack (tp {tp}, pp {pp}, ep {ep})'s {PER_RANK_FILE}: the copy is incomplete"
            )
        self._models: dict[tuple[int, int, int], dict] = {(0, 0, 0): first}
        self._counts: dict[int, int] = {}
        self._shapes: dict[str, tuple[int, ...]] | None = None
        chunk_keys = (f"model{v}" for v in itertools.count())
        self.chunks = ["model"] if "model" in first else list(itertools.takewhile(first.__contains__, chunk_keys))
        if not self.chunks:
            raise CheckpointError(f"Megatron checkpoint {directory}: {self.files[(0, 0, 0)] / PER_RANK_FILE} holds no 'model' or 'model0'")
        self.common = {k: v for k, v in first.items() if k not in self.chunks and k != "optimizer"}
        self.swiglu = bool(getattr(self.common.get("args"), "swiglu", False))
        # (pp rank, chunk key) of each pipeline stage, in the model's order
        self.stages = [(stage % self.pp, self.chunks[stage // self.pp]) for stage in range(self.pp * len(self.chunks))]

    def _load(self, tp: int, pp: int, ep: int = 0) -> dict:
        """A rank's file, memory-mapped: its tensors' bytes are read only where a region uses them
        (the optimizer state never), and only the files a region overlaps are opened."""
        if (tp, pp, ep) not in self._models:
            self._models[(tp, pp, ep)] = load_pickle(self.files[(tp, pp, ep)] / PER_RANK_FILE, mmap=True)
        return self._models[(tp, pp, ep)]

    def _model(self, tp: int, stage: int, ep: int = 0) -> dict:
        pp, chunk = self.stages[stage]
        saved = self._load(tp, pp, ep)
        if chunk not in saved:
            where = self.files[(tp, pp, ep)] / PER_RANK_FILE
            raise CheckpointError(f"Megatron checkpoint {self.directory}: {where} has no '{chunk}' (rank 0's file has {self.chunks})")
        return saved[chunk]

    def _layer_count(self, stage: int) -> int:
        """The layers of `stage`, counted in the file of the tp rank 0 (of its stage)."""
        if stage not in self._counts:
            suffix = ".self_attention.linear_qkv.weight"
            self._counts[stage] = sum(1 for k in self._model(0, stage) if k.startswith("decoder.layers.") and k.endswith(suffix))
        return self._counts[stage]

    def _even_layers(self) -> int | None:
        """Layers per stage when the args say the split is even (Megatron's default), else None:
        then each stage's file is opened to count them."""
        args = self.common.get("args")
        layers = getattr(args, "num_layers", None)
        uneven = any(getattr(args, name, None) for name in UNEVEN_SPLIT_ARGS)
        return layers // len(self.stages) if layers and not uneven and layers % len(self.stages) == 0 else None

    def num_layers(self) -> int:
        even = self._even_layers()
        return even * len(self.stages) if even is not None else sum(self._layer_count(s) for s in range(len(self.stages)))

    def _layer_at(self, layer: int) -> tuple[int, int]:
        """(stage, layer within it) of global layer `layer`; the stage's file is checked to hold it."""
        even = self._even_layers()
        if even is not None:
            stage, i = divmod(layer, even)
            if self._layer_count(stage) != even:
                raise CheckpointError(
                    f"Megatron checkpoint {self.directory}: pipeline stage {stage} holds {self._layer_count(stage)} layers, "
                    f"but its args' num_layers={even * len(self.stages)} split evenly over {len(self.stages)} stages gives {even}"
                )
            return stage, i
        for stage in range(len(self.stages)):
            if layer < self._layer_count(stage):
                return stage, layer
            layer -= self._layer_count(stage)
        raise KeyError(layer)

    def _stored_name(self, model: dict, layer: int, rest: str) -> str:
        name = f"decoder.layers.{layer}.{rest}"
        return name if name in model or rest not in LOCAL_NORM_NAMES else f"decoder.layers.{layer}.{LOCAL_NORM_NAMES[rest]}"

    def _tp_pieces(self, key: str, full: int) -> list[list[tuple[int, int, int]]]:
        """Per tp rank, the (start in the full tensor, start in its part, length) of its rows
        along the split dim, whose full size is `full`: one block, or SwiGLU's linear_fc1 as
        [its gate rows; its fc1 rows] of the full [gate; fc1]."""
        local = full // self.tp
        if self.swiglu and ".linear_fc1." in key:
            half = local // 2
            return [[(t * half, 0, half), (full // 2 + t * half, half, half)] for t in range(self.tp)]
        return [[(t * local, 0, local)] for t in range(self.tp)]

    def _joined_region(self, key: str, part_of, full_shape, at, shape, stage: int, ep: int = 0) -> torch.Tensor:
        """The region (at, shape) of the tensor joined over tp ranks (full_shape), each rank's
        part from part_of(tp) (a file of `stage` and `ep`); only the ranks whose rows the region
        overlaps are read, and a replicated tensor from a file already open where one is."""
        dim = next((d for suffix, d in TP_DIM.items() if key.endswith(suffix)), None)

        def narrowed(part: torch.Tensor, skip: int | None) -> torch.Tensor:
            for d, (start, size) in enumerate(zip(at, shape)):
                part = part if d == skip else part.narrow(d, start, size)
            return part

        if dim is None or self.tp == 1:
            pp = self.stages[stage][0]
            held = [t for t in range(self.tp) if (t, pp, ep) in self._models] or [0]
            return narrowed(part_of(held[0]), None).clone()
        out, lo, hi = None, at[dim], at[dim] + shape[dim]
        for tp, pieces in enumerate(self._tp_pieces(key, full_shape[dim])):
            for full_start, local_start, length in pieces:
                a, b = max(lo, full_start), min(hi, full_start + length)
                if a < b:
                    part = part_of(tp)
                    out = torch.empty(shape, dtype=part.dtype) if out is None else out
                    out.narrow(dim, a - lo, b - a).copy_(narrowed(part, dim).narrow(dim, local_start + a - full_start, b - a))
        return out

    def region(self, key: str, at: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region (at, shape) of torch_dist's stacked tensor `key`, read from the files that hold it."""
        full = self.shapes()[key]
        if not key.startswith("decoder.layers."):
            stage = len(self.stages) - 1 if key.startswith(("decoder.final", "output_layer")) else 0
            return self._joined_region(key, lambda tp: self._model(tp, stage)[key], full, at, shape, stage)
        rest = key[len("decoder.layers."):]
        layers = []
        for layer in range(at[0], at[0] + shape[0]):
            stage, i = self._layer_at(layer)
            if rest.startswith(EXPERT_KEY):
                layers.append(self._expert_region(key, stage, i, rest, full[1:], at[1:], shape[1:]))
            else:
                name = lambda tp: self._stored_name(self._model(tp, stage), i, rest)  # noqa: E731
                part_of = lambda tp: self._model(tp, stage)[name(tp)]  # noqa: E731
                layers.append(self._joined_region(key, part_of, full[1:], at[1:], shape[1:], stage))
        return torch.stack(layers)

    def _local_experts(self, stage: int, layer: int, ep: int = 0) -> list[int]:
        prefix = f"decoder.layers.{layer}.{LOCAL_EXPERTS}"
        return sorted({int(k[len(prefix):].split(".")[0]) for k in self._model(0, stage, ep) if k.startswith(prefix)})

    def _expert_region(self, key: str, stage: int, layer: int, rest: str, full, at, shape) -> torch.Tensor:
        """Experts at[0] .. of one layer (E, ...) in global order: ep rank r holds r * E_local + k."""
        per_rank = len(self._local_experts(stage, layer))
        prefix, suffix = f"decoder.layers.{layer}.{LOCAL_EXPERTS}", rest[len(EXPERT_KEY):]
        experts = []
        for expert in range(at[0], at[0] + shape[0]):
            ep, k = divmod(expert, per_rank)
            name = f"{prefix}{k}.{suffix}"
            part_of = lambda tp: self._model(tp, stage, ep)[name]  # noqa: E731
            experts.append(self._joined_region(key, part_of, full[1:], at[1:], shape[1:], stage, ep))
        return torch.stack(experts)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """torch_dist's stacked shape of each tensor the checkpoint holds, from the shapes of the
        first (and last) stage's tensors in tp rank 0's file: no tensor is read or built."""
        if self._shapes is not None:
            return self._shapes
        keys = set(GLOBAL_KEYS.values()) | {"decoder.layers." + k for k in LAYER_KEYS.values()}
        shapes = {}
        for key in keys:
            dim = next((d for suffix, d in TP_DIM.items() if key.endswith(suffix)), None)
            if not key.startswith("decoder.layers."):
                stage = len(self.stages) - 1 if key.startswith(("decoder.final", "output_layer")) else 0
                part, lead = self._model(0, stage).get(key), ()
            else:
                rest = key[len("decoder.layers."):]
                model, lead = self._model(0, 0), (self.num_layers(),)
                if rest.startswith(EXPERT_KEY):
                    local = self._local_experts(0, 0)
                    part = model.get(f"decoder.layers.0.{LOCAL_EXPERTS}{local[0]}.{rest[len(EXPERT_KEY):]}") if local else None
                    lead = (*lead, len(local) * self.ep)
                else:
                    part = model.get(self._stored_name(model, 0, rest))
            if part is None:
                continue  # not in this checkpoint (tied head, no learned positions, no bias)
            size = list(part.shape)
            if dim is not None:
                size[dim] *= self.tp
            shapes[key] = (*lead, *size)
        self._shapes = shapes
        return shapes
