"""The optimizer state of Megatron-LM's per-rank format (--ckpt-format torch), per file, by the
file's own parameter names.

What Megatron-LM's legacy save writes (megatron/training/checkpointing.py, generate_state_dict)
into each mp_rank_*/model_optim_rng.pt under "optimizer" is its optimizer's state_dict():

    FP32Optimizer (fp32 training)      torch's Adam state_dict: "state" by parameter index (exp_avg,
                                       exp_avg_sq, step), "param_groups" each listing its indices
    Float16OptimizerWithFloat16Params  {"optimizer": that state_dict, "fp32_from_fp16_params": the
    (fp16, bf16)                       fp32 master weights, per group in the group's order,
                                       "grad_scaler"}
    DistributedOptimizer               {"optimizer": the param groups, each with its "step", no
    (--use-distributed-optimizer)      state}; the state is in distrib_optim.pt beside it
                                       (save_parameter_state): {"buckets_coalesced": True,
                                       <gbuf>: {(param dtype, grad dtype): {"param", "exp_avg",
                                       "exp_avg_sq": flat fp32 over the buffer, buckets unpadded
                                       and back to back, "numel_unpadded"}}}

An index names the parameter by position: megatron-core's _get_param_groups puts each parameter
(in named_parameters order, which is the order of the file's model keys) into a group by its
overrides (no weight decay for biases and 1-D tensors; with --decoupled-lr the word embeddings and
output layer on their own), and torch numbers the groups' parameters in turn. The groups' own
fields do not say which rule made them, so each group is matched to the one class of parameters
whose shapes, in order, are the shapes of its state; anything else is not mapped. Each file's
distrib_optim.pt holds that file's parameters (distrib_optim.py), at any tp and pp, a grad buffer
per virtual pipeline chunk.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.megatron.distrib_optim import DISTRIB_OPTIM_FILE, Unmapped, distributed_slots
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE

DECOUPLED = ("embedding.word_embeddings.weight", "output_layer.weight")
"""megatron-core's is_embedding_or_output_parameter: the tensors --decoupled-lr moves to a group of their own."""

Slots = dict[str, dict[str, torch.Tensor]]  # slot -> {file key: tensor}


def parameters(model: dict) -> list[tuple[str, torch.Tensor]]:
    """A model chunk's parameters in megatron-core's named_parameters order (its state dict's)."""
    return [(k, v) for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]


def param_class(key: str, value: torch.Tensor, decoupled: bool) -> tuple[bool, bool]:
    """(no weight decay, in --decoupled-lr's group) of a parameter, as megatron-core's
    _get_param_groups sorts it: biases and 1-D tensors take no weight decay."""
    return value.dim() == 1 or key.endswith(".bias"), decoupled and key in DECOUPLED


def file_state(saved: dict, directory: Path, chunks: list[str], pp: int, pp_rank: int) -> tuple[dict[str, Slots], float]:
    """{chunk: {slot: {key: tensor}}} and the Adam step of one per-rank file (of pipeline rank
    `pp_rank` of `pp`), or Unmapped."""
    optimizer = saved.get("optimizer")
    params = [(chunk, key, value) for chunk in chunks for key, value in parameters(saved.get(chunk, {}))]
    if isinstance(optimizer, list):
        raise Unmapped("holds several chained optimizers (MoE experts, or Muon and its Adam), which dtgpt does not map yet")
    if not isinstance(optimizer, dict):
        raise Unmapped("holds no optimizer state (saved with --no-save-optim)")
    inner = optimizer.get("optimizer", optimizer)
    if "state" in inner:
        by_index, step = _indexed(inner, optimizer.get("fp32_from_fp16_params"), params)
    elif (directory / DISTRIB_OPTIM_FILE).is_file():
        weights = [[(key, value) for of, key, value in params if of == chunk] for chunk in chunks]  # a grad buffer each
        by_index, step = distributed_slots(directory / DISTRIB_OPTIM_FILE, weights, saved.get("args"), pp, pp_rank), _group_step(inner)
    else:
        raise Unmapped(f"is the distributed optimizer's, but {directory / DISTRIB_OPTIM_FILE} is missing")
    out: dict[str, Slots] = {chunk: {} for chunk in chunks}
    for (chunk, key, _), slots in zip(params, by_index):
        for slot, value in slots.items():
            out[chunk].setdefault(slot, {})[key] = value
    return out, step


def _indexed(inner: dict, masters, params: list) -> tuple[list[dict[str, torch.Tensor]], float]:
    """Each parameter's slots from torch's state by index (FP32Optimizer, Float16Optimizer)."""
    groups = [g["params"] for g in inner["param_groups"] if g["params"]]
    state = inner["state"]
    if any(i not in state for g in groups for i in g):
        raise Unmapped("holds no Adam state for some parameters (saved before the first step?)")
    order = _assign(groups, inner["param_groups"], state, params)
    by_index = [{} for _ in params]
    for g, group in enumerate(groups):
        for j, (index, param) in enumerate(zip(group, order[g])):
            slots = {"exp_avg": state[index]["exp_avg"], "exp_avg_sq": state[index]["exp_avg_sq"]}
            if masters is not None:
                if len(masters[g]) != len(group) or masters[g][j].shape != params[param][2].shape:
                    raise Unmapped("has fp32_from_fp16_params that do not follow its param groups")
                slots["fp32_param"] = masters[g][j]
            by_index[param] = slots
    steps = {float(s["step"]) for s in state.values() if "step" in s}
    if len(steps) != 1:
        raise Unmapped(f"holds Adam steps {sorted(steps)} (one step count expected)")
    return by_index, steps.pop()


def _assign(groups: list[list[int]], saved_groups: list[dict], state: dict, params: list) -> list[list[int]]:
    """The parameter positions of each group: the one class (megatron-core's grouping, with or
    without --decoupled-lr) whose shapes are the group's state's shapes, in order."""
    live = [g for g in saved_groups if g["params"]]
    for decoupled in (True, False):
        classes: dict[tuple[bool, bool], list[int]] = {}
        for p, (_, key, value) in enumerate(params):
            classes.setdefault(param_class(key, value, decoupled), []).append(p)
        order = []
        for group, saved in zip(groups, live):
            shapes = [tuple(state[i]["exp_avg"].shape) for i in group]
            found = [members for (no_wd, _), members in classes.items()
                     if no_wd == (saved.get("wd_mult", 1.0) == 0.0) and [tuple(params[p][2].shape) for p in members] == shapes]  # fmt: skip
            if len(found) != 1:
                break
            order.append(found[0])
        if len(order) == len(groups) and sorted(p for members in order for p in members) == list(range(len(params))):
            return order
    raise Unmapped("has param groups that match megatron-core's grouping of this file's parameters in no way dtgpt knows")


def _group_step(inner: dict) -> float:
    """The distributed optimizer's Adam step: its param groups' (they hold no per-parameter state)."""
    steps = {float(g["step"]) for g in inner.get("param_groups", []) if "step" in g}
    if len(steps) != 1:
        raise Unmapped(f"holds param-group steps {sorted(steps)} (one step count expected)")
    return steps.pop()


class PerRankOptimizer:
    """The optimizer state of a PerRankModel's files, mapped file by file as regions ask: view(slot)
    reads it with the model's own gluing of tp shards and pipeline stages."""

    def __init__(self, model):
        self.model = model  # a PerRankModel
        self._files: dict[tuple[int, int, int], tuple[dict[str, Slots], float]] = {}
        self._views: dict[str, object] = {}

    def _file(self, tp: int, pp: int, ep: int = 0) -> tuple[dict[str, Slots], float]:
        if (tp, pp, ep) not in self._files:
            where = self.model.files[(tp, pp, ep)]
            self._files[(tp, pp, ep)] = file_state(self.model._load(tp, pp, ep), where, self.model.chunks, self.model.pp, pp)
        return self._files[(tp, pp, ep)]

    @functools.cached_property
    def first(self) -> tuple[list[str], float | None, str]:
        """(the slots stored, the Adam step, why not mapped: "" when mapped), from rank 0's file
        and, at pp > 1, the last stage's (its distrib_optim.pt is cut by rules of its own: one
        bucket past pp rank 0, a tied head's copy in a bucket of its own). Any other file is
        mapped when a region first reads it."""
        for pp in dict.fromkeys((self.model.pp - 1, 0)):
            try:
                slots, step = self._file(0, pp, 0)
            except Unmapped as e:
                return [], None, f"{self.model.files[(0, pp, 0)] / PER_RANK_FILE} {e}"
        return sorted(slots[self.model.chunks[0]]), step, ""

    def view(self, slot: str):
        """The PerRankModel whose files hold optimizer state `slot` in place of the weights."""
        if slot not in self._views:
            view = copy.copy(self.model)
            view._model = functools.partial(self._slot_model, slot)
            self._views[slot] = view
        return self._views[slot]

    def _slot_model(self, slot: str, tp: int, stage: int, ep: int = 0) -> dict[str, torch.Tensor]:
        pp, chunk = self.model.stages[stage]
        where = self.model.files[(tp, pp, ep)] / PER_RANK_FILE
        try:
            slots = self._file(tp, pp, ep)[0][chunk]
        except Unmapped as e:
            raise CheckpointError(f"Megatron checkpoint {self.model.directory}: {where} {e}, but rank 0's is mapped") from None
        if slot not in slots:
            raise CheckpointError(f"Megatron checkpoint {self.model.directory}: {where} holds no optimizer state {slot}")
        return slots[slot]
