"""Megatron-LM's per-rank format (mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt), read as
torch_dist's stacked, full tensors (reader.py reads either format by dtgpt name).

Each (tp, pp, ep) rank's file holds its pipeline stage's layers, numbered within the stage, its
TP split of each tensor, and, in an MoE layer, only its expert-parallel rank's routed experts as
`mlp.experts.local_experts.<K>.`: ep rank r's expert K is the global expert r * E_local + K.
Everything outside the routed experts is the same in every ep rank's file (ep rank 0's is read).
"""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import torch

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, grad_scaler, load_pickle, per_rank_dirs
from dtgpt.checkpoint.megatron.keys import EXPERT_KEY, OPTIMIZER_PREFIX
from dtgpt.checkpoint.megatron.per_rank_optim import PerRankOptimizer
from dtgpt.config import ConfigError
from dtgpt.config.pipeline_split import PER_VIRTUAL, SPLIT_KEYS, keyed_stage_layers

TP_DIM = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_fc1.bias": 0,
          "word_embeddings.weight": 0, "output_layer.weight": 0, "linear_proj.weight": 1, "linear_fc2.weight": 1,
          "linear_q_proj.weight": 0, "linear_q_up_proj.weight": 0, "linear_kv_up_proj.weight": 0, "eh_proj.weight": 0,
          "linear_q_down_proj.weight": 0, "linear_kv_down_proj.weight": 0, "core_attention.softmax_offset": 0}  # fmt: skip
"""How the per-rank format splits a tensor over TP ranks (column parallel: rows; row parallel:
columns); anything not named is replicated (norms, routers). Multi-latent attention's
up-projections are column parallel (their rows are the heads in turn), and under the local layer
spec, which megatron-core builds on CPU and dtgpt writes, so are its down-projections
(ColumnParallelLinear, their output gathered in the forward); Transformer Engine's spec keeps
those duplicated on every rank (DUPLICATED), as its fused norm names tell. The multi-token
prediction module's eh_proj is column parallel, the attention sink's logits split by head."""

DUPLICATED = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
TE_MLA_NORM = ".self_attention.linear_kv_up_proj.layer_norm_weight"
"""A name only Transformer Engine's MLA layer spec gives: its down-projections are whole on every tp rank."""
BLOCK = re.compile(r"decoder\.layers\.(\d+)\.|mtp\.layers\.\d+\.transformer_layer\.")
"""The per-rank prefix of a block's tensors: a decoder layer's (numbered within its stage) or an MTP block's."""


def tp_dim(key: str, duplicated: bool = False) -> int | None:
    """The dim of per-rank key `key` split over tp (TP_DIM), or None; `duplicated`: the
    down-projections are whole (Transformer Engine's MLA spec)."""
    if duplicated and key.endswith(DUPLICATED):
        return None
    return next((d for suffix, d in TP_DIM.items() if key.endswith(suffix)), None)

LOCAL_EXPERTS = "mlp.experts.local_experts."
UNEVEN_SPLIT_ARGS = tuple(key for key in SPLIT_KEYS if key != PER_VIRTUAL)
"""Megatron's args that make its pipeline split uneven."""


def describe_split(args) -> str:
    """The args that choose the split, as `name=value`."""
    said = [f"num_layers={getattr(args, 'num_layers', None)}"]
    return ", ".join(said + [f"{name}={getattr(args, name)!r}" for name in UNEVEN_SPLIT_ARGS if getattr(args, name, None)])


def args_split(args, pp: int, vp: int) -> list[int] | None:
    """The layers of each of pp * vp stages that Megatron's saved args give, or None where they
    give none (no layer count; an even split that does not divide; a split dtgpt's rules refuse)."""
    layers = getattr(args, "num_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return None
    try:
        uneven = keyed_stage_layers(args, layers, pp, vp, getattr(args, "mtp_num_layers", None) or 0)
    except ConfigError:
        return None
    if uneven is not None:
        return uneven
    return [layers // (pp * vp)] * (pp * vp) if layers % (pp * vp) == 0 else None


def _expert_parallel(saved: dict) -> bool:
    """Whether mp_rank_TT_NNN names ep ranks: a file's args say ep > 1 with pp 1."""
    args = saved.get("args")
    return getattr(args, "expert_model_parallel_size", 1) > 1 and getattr(args, "pipeline_model_parallel_size", 1) <= 1


def _check_rank_counts(directory: Path, args: dict, tp: int, pp: int) -> None:
    """As many tp ranks as rank 0's args name (a missing last rank's directory would otherwise
    read as a smaller tp, another checkpoint's copied in as a larger one), and no fewer pp ranks
    (more: files cut into stages after the save keep the args they had)."""
    tp_said, pp_said = args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size")
    for key, said, found, dim in (("tensor_model_parallel_size", tp_said, tp, "tp"), ("pipeline_model_parallel_size", pp_said, pp, "pp")):
        if isinstance(said, int) and (said > found or (dim == "tp" and said != found)):
            raise CheckpointError(
                f"Megatron checkpoint {directory}: its args say {key}={said}, but its mp_rank_* directories hold {found} "
                f"{dim} rank{'s' if found > 1 else ''}: a rank's directory is missing, or another checkpoint's was added"
            )


def _check_expert_split(directory: Path, args: dict, tp: int) -> None:
    """The routed experts split over the tp ranks as the dense MLP: Megatron's default
    (expert_tensor_parallel_size unset, or absent from older args, means tp). Files saved with
    another expert tp split hold another slicing (and, at 1, other rank names): refused."""
    etp = args.get("expert_tensor_parallel_size")
    if args.get("num_experts") and isinstance(etp, int) and etp != tp:
        raise CheckpointError(
            f"Megatron checkpoint {directory}: its args say expert_tensor_parallel_size={etp} with "
            f"tensor_model_parallel_size={tp}; the per-rank reader takes experts split over tp as the dense MLP "
            "(expert_tensor_parallel_size = tp, Megatron's default): save it from Megatron in torch_dist "
            "(--ckpt-format torch_dist), whose tensors are whole whatever the split"
        )


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
        _check_rank_counts(directory, getattr(first.get("args"), "__dict__", {}), self.tp, self.pp)
        _check_expert_split(directory, getattr(first.get("args"), "__dict__", {}), self.tp)
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
        scaler = grad_scaler(first.get("optimizer"))  # fp16's loss scale, beside the optimizer state
        if scaler:
            self.common["optimizer"] = {"grad_scaler": scaler}
        self.optimizer = PerRankOptimizer(self)  # the optimizer state, read as the weights are
        self.swiglu = bool(getattr(self.common.get("args"), "swiglu", False))
        # (pp rank, chunk key) of each pipeline stage, in the model's order
        self.stages = [(stage % self.pp, self.chunks[stage // self.pp]) for stage in range(self.pp * len(self.chunks))]
        # whether MLA's down-projections are whole in every tp rank's file (Transformer Engine's spec)
        self.duplicated = any(key.endswith(TE_MLA_NORM) for key in self._model(0, 0))
        self._where: dict[str, tuple[int | None, str | None, str]] = {}  # set by shapes(): see region()
        self._experts: dict[tuple[int, str], list[int]] = {}

    def _load(self, tp: int, pp: int, ep: int = 0) -> dict:
        """A rank's file, memory-mapped: its tensors' bytes are read only where a region uses them
        (the optimizer state only where a region of it is asked for), and only the files a region
        overlaps are opened."""
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

    def _part(self, tp: int, stage: int, name: str, ep: int = 0) -> torch.Tensor:
        """Tensor `name` of a rank's file, shaped as tp rank 0's (whose shapes check() compared
        with the model), or one line naming the file and key."""
        part, first = self._model(tp, stage, ep).get(name), self._model(0, stage, ep).get(name)
        where = f"Megatron checkpoint {self.directory}: {self.files[(tp, self.stages[stage][0], ep)] / PER_RANK_FILE}"
        if part is None:
            raise CheckpointError(f"{where} has no {name}, which tp rank 0's file has")
        if first is not None and part.shape != first.shape:
            raise CheckpointError(f"{where} holds {name} of shape {tuple(part.shape)} but tp rank 0's file {tuple(first.shape)}")
        return part

    def _layer_count(self, stage: int) -> int:
        """The layers of `stage`, counted in the file of the tp rank 0 (of its stage)."""
        if stage not in self._counts:
            suffix = ".self_attention.linear_proj.weight"
            self._counts[stage] = sum(1 for k in self._model(0, stage) if k.startswith("decoder.layers.") and k.endswith(suffix))
        return self._counts[stage]

    @functools.cached_property
    def _args_split(self) -> list[int] | None:
        """The layers of each stage that the args' split gives (Megatron's rules: even, or its
        uneven-split args, dtgpt/config/pipeline_split.py), at the files' pp and virtual stages;
        None where the args give none (then each stage's file is counted, unchecked)."""
        return args_split(self.common.get("args"), self.pp, len(self.chunks))

    def num_layers(self) -> int:
        split = self._args_split
        return sum(split) if split is not None else sum(self._layer_count(s) for s in range(len(self.stages)))

    def _layer_at(self, layer: int) -> tuple[int, int]:
        """(stage, layer within it) of global layer `layer`; where the args give the split, only
        that stage's file is opened, and checked to hold the layers the split gives it."""
        split = self._args_split
        counts = split if split is not None else [self._layer_count(s) for s in range(len(self.stages))]
        for stage, count in enumerate(counts):
            if layer < count:
                break
            layer -= count
        else:
            raise KeyError(layer)
        if split is not None and self._layer_count(stage) != count:
            raise CheckpointError(
                f"Megatron checkpoint {self.directory}: pipeline stage {stage} holds {self._layer_count(stage)} layers, but "
                f"its args' split ({describe_split(self.common.get('args'))}) over {len(self.stages)} stages gives {count}"
            )
        return stage, layer

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
        dim = tp_dim(key, self.duplicated)

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

    def _offset(self, stage: int) -> int:
        """The global index of `stage`'s first decoder layer."""
        return sum(self._layer_count(s) for s in range(stage))

    def _block_names(self, stage: int, prefix: str) -> tuple[str, ...]:
        model = self._model(0, stage)
        return tuple(k[len(prefix):] for k in model if k.startswith(prefix))

    def _first_with_layers(self) -> int:
        """The first stage that holds decoder layers: stage 0, unless it holds only the embedding
        (Megatron's account_for_embedding_in_pipeline_split, or a layout's 'E|...')."""
        return next((s for s in range(len(self.stages)) if self._layer_count(s)), 0)

    def per_layer(self) -> bool:
        """Whether the decoder layers differ in tensors (dense and MoE layers mixed): then they
        are read apart (`decoder.layers.<i>.`), as megatron-core's torch_dist keeps them."""
        first = self._block_names(self._first_with_layers(), "decoder.layers.0.")
        return any(self._block_names(stage, f"decoder.layers.{i}.") != first
                   for stage in range(len(self.stages)) for i in range(self._layer_count(stage)))  # fmt: skip

    def region(self, key: str, at: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region (at, shape) of torch_dist's tensor `key` (stacked on a layer axis, or not:
        see shapes), or of its optimizer state `optimizer.state.<slot>.<key>`, read from the files
        that hold it."""
        if key.startswith(OPTIMIZER_PREFIX):
            slot, key = key[len(OPTIMIZER_PREFIX):].split(".", 1)
            return self.optimizer.view(slot).region(key, at, shape)
        full = self.shapes()[key]
        stage, prefix, rest = self._where[key]
        if prefix is None:  # outside the blocks
            return self._joined_region(key, lambda tp: self._part(tp, stage, key), full, at, shape, stage)
        if stage is not None:  # one block: a layer kept apart, or an MTP block
            return self._block_region(stage, prefix, rest, full, at, shape)
        layers = []
        for layer in range(at[0], at[0] + shape[0]):
            stage, i = self._layer_at(layer)
            layers.append(self._block_region(stage, f"decoder.layers.{i}.", rest, full[1:], at[1:], shape[1:]))
        return torch.stack(layers)

    def _block_region(self, stage: int, prefix: str, rest: str, full, at, shape) -> torch.Tensor:
        """The region of one block's tensor `rest`, stored under `prefix` in `stage`'s files."""
        if rest.startswith(EXPERT_KEY):
            return self._expert_region(stage, prefix, rest, full, at, shape)
        name = prefix + rest
        return self._joined_region(name, lambda tp: self._part(tp, stage, name), full, at, shape, stage)

    def _local_experts(self, stage: int, prefix: str) -> list[int]:
        """The local expert numbers of the block under `prefix` in `stage`'s files."""
        if (stage, prefix) not in self._experts:
            local = prefix + LOCAL_EXPERTS
            found = {int(k[len(local):].split(".")[0]) for k in self._model(0, stage) if k.startswith(local)}
            self._experts[(stage, prefix)] = sorted(found)
        return self._experts[(stage, prefix)]

    def _expert_region(self, stage: int, prefix: str, rest: str, full, at, shape) -> torch.Tensor:
        """Experts at[0] .. of one block (E, ...) in global order: ep rank r holds r * E_local + k."""
        per_rank = len(self._local_experts(stage, prefix))
        suffix = rest[len(EXPERT_KEY):]
        experts = []
        for expert in range(at[0], at[0] + shape[0]):
            ep, k = divmod(expert, per_rank)
            name = f"{prefix}{LOCAL_EXPERTS}{k}.{suffix}"
            part_of = lambda tp: self._part(tp, stage, name, ep)  # noqa: E731
            experts.append(self._joined_region(name, part_of, full[1:], at[1:], shape[1:], stage, ep))
        return torch.stack(experts)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """torch_dist's shape of each tensor the checkpoint holds, by the files' own names (the
        local spec's norms: keys.STORED_ALIASES), from the shapes in tp rank 0's files: no
        tensor is read or built. The decoder layers are stacked on a leading axis as torch_dist
        stacks them, or, where they differ (per_layer), kept apart under `decoder.layers.<i>.`;
        the routed experts on a global expert axis."""
        if self._shapes is not None:
            return self._shapes
        last, apart, layered = len(self.stages) - 1, self.per_layer(), self._first_with_layers()
        self._shapes, self._where = {}, {}
        for stage in range(len(self.stages)) if apart else sorted({0, layered, last}):
            offset = self._offset(stage)
            for name, part in self._model(0, stage).items():
                if not isinstance(part, torch.Tensor):
                    continue  # _extra_state
                match, lead, key, where = BLOCK.match(name), (), name, (stage, None, name)
                if not match and key in self._shapes:
                    continue  # outside the blocks: the first stage's that holds it (stage 0's embedding)
                if match:
                    prefix, rest = match.group(0), name[match.end():]
                    if rest.startswith(LOCAL_EXPERTS):
                        expert, suffix = rest[len(LOCAL_EXPERTS):].split(".", 1)
                        if int(expert) != self._local_experts(stage, prefix)[0]:
                            continue
                        rest, lead = EXPERT_KEY + suffix, (len(self._local_experts(stage, prefix)) * self.ep,)
                    if match.group(1) is None:  # an MTP block
                        key, where = prefix + rest, (stage, prefix, rest)
                    elif apart:
                        key = f"decoder.layers.{offset + int(match.group(1))}.{rest}"
                        where = (stage, prefix, rest)
                    elif stage == layered and match.group(1) == "0":
                        key, where, lead = "decoder.layers." + rest, (None, "decoder.layers.", rest), (self.num_layers(), *lead)
                    else:
                        continue
                size = list(part.shape)
                dim = tp_dim(name, self.duplicated)
                if dim is not None:
                    size[dim] *= self.tp
                self._shapes[key], self._where[key] = (*lead, *size), where
        slots = self.optimizer.first[0]  # each slot shaped as its parameter, as torch_dist's model-space state
        self._shapes.update({f"{OPTIMIZER_PREFIX}{slot}.{key}": shape for slot in slots for key, shape in list(self._shapes.items())})
        return self._shapes
