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
        first = load_pickle(first_dir / PER_RANK_FILE)
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
        self._last: tuple[str, torch.Tensor] | None = None
        chunk_keys = (f"model{v}" for v in itertools.count())
        self.chunks = ["model"] if "model" in first else list(itertools.takewhile(first.__contains__, chunk_keys))
        if not self.chunks:
            raise CheckpointError(f"Megatron checkpoint {directory}: {self.files[(0, 0, 0)] / PER_RANK_FILE} holds no 'model' or 'model0'")
        self.common = {k: v for k, v in first.items() if k not in self.chunks and k != "optimizer"}
        self.swiglu = bool(getattr(self.common.get("args"), "swiglu", False))
        # (pp rank, chunk key) of each pipeline stage, in the model's order
        self.stages = [(stage % self.pp, self.chunks[stage // self.pp]) for stage in range(self.pp * len(self.chunks))]

    def _load(self, tp: int, pp: int, ep: int = 0) -> dict:
        if (tp, pp, ep) not in self._models:
            self._models[(tp, pp, ep)] = load_pickle(self.files[(tp, pp, ep)] / PER_RANK_FILE)
        return self._models[(tp, pp, ep)]

    def _model(self, tp: int, stage: int, ep: int = 0) -> dict:
        pp, chunk = self.stages[stage]
        saved = self._load(tp, pp, ep)
        if chunk not in saved:
            where = self.files[(tp, pp, ep)] / PER_RANK_FILE
            raise CheckpointError(f"Megatron checkpoint {self.directory}: {where} has no '{chunk}' (rank 0's file has {self.chunks})")
        return saved[chunk]

    def _layer_count(self, stage: int) -> int:
        suffix = ".self_attention.linear_qkv.weight"
        return sum(1 for k in self._model(0, stage) if k.startswith("decoder.layers.") and k.endswith(suffix))

    def _stored_name(self, model: dict, layer: int, rest: str) -> str:
        name = f"decoder.layers.{layer}.{rest}"
        return name if name in model or rest not in LOCAL_NORM_NAMES else f"decoder.layers.{layer}.{LOCAL_NORM_NAMES[rest]}"

    def _join_tp(self, key_of_rank, key: str) -> torch.Tensor:
        parts = [key_of_rank(tp) for tp in range(self.tp)]
        dim = next((d for suffix, d in TP_DIM.items() if key.endswith(suffix)), None)
        if dim is None:
            return parts[0]
        if self.swiglu and ".linear_fc1." in key:
            # Each rank holds [its gate rows; its fc1 rows]; torch_dist's full tensor is [gate; fc1].
            halves = [part.chunk(2, dim=0) for part in parts]
            parts = [gate for gate, _ in halves] + [fc1 for _, fc1 in halves]
        return torch.cat(parts, dim)

    def stacked(self, key: str) -> torch.Tensor:
        """One stacked tensor, glued from every rank's file (the last one is kept: a reader asks
        for it once per layer)."""
        if self._last is None or self._last[0] != key:
            self._last = (key, self._glue(key))
        return self._last[1]

    def _experts(self, stage: int, layer: int, rest: str) -> torch.Tensor:
        """One layer's routed experts (E, ...) in global order: every ep rank's, in rank order."""
        suffix = rest[len(EXPERT_KEY):]
        experts = []
        for ep in range(self.ep):
            prefix = f"decoder.layers.{layer}.{LOCAL_EXPERTS}"
            local = sorted({int(k[len(prefix):].split(".")[0]) for k in self._model(0, stage, ep) if k.startswith(prefix)})
            for k in local:
                key = f"{prefix}{k}.{suffix}"
                experts.append(self._join_tp(lambda tp: self._model(tp, stage, ep)[key], key))
        if not experts:
            raise KeyError(rest)
        return torch.stack(experts)

    def _glue(self, key: str) -> torch.Tensor:
        if not key.startswith("decoder.layers."):
            stage = len(self.stages) - 1 if key.startswith(("decoder.final", "output_layer")) else 0
            return self._join_tp(lambda tp: self._model(tp, stage)[key], key)
        rest = key[len("decoder.layers."):]
        layers = []
        for stage in range(len(self.stages)):
            for i in range(self._layer_count(stage)):
                if rest.startswith(EXPERT_KEY):
                    layers.append(self._experts(stage, i, rest))
                else:
                    layers.append(self._join_tp(lambda tp: self._model(tp, stage)[self._stored_name(self._model(tp, stage), i, rest)], key))
        if not layers:  # a file without transformer layers: check() names what the model misses
            raise KeyError(key)
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
