"""dtgpt's AdamW state as the "optimizer" entry of Megatron-LM's per-rank files: what its
non-distributed optimizers' state_dict() gives (per_rank_optim.py reads the same back).

    fp32 run   FP32Optimizer: torch's AdamW state_dict, `state` by parameter index (step,
               exp_avg, exp_avg_sq), `param_groups` listing the indices
    bf16/fp16  Float16OptimizerWithFloat16Params: {"optimizer": that, "fp32_from_fp16_params":
               the fp32 master weights (dtgpt's parameters), per group in the group's order}

The groups are megatron-core's (_get_param_groups, its standard overrides): weight decay on the
matrices, then under decoupled_lr the word embedding and output layer, then no weight decay on
biases and 1-D tensors; each group holds its parameters in the file's model order, and every
file has every group (megatron-core aligns the groups over ranks), empty or not.
"""

from __future__ import annotations

import re

import torch

from dtgpt.checkpoint.megatron.layer_orders import AFTER, BEFORE, LAYER_SPECS, MLA_KEYS
from dtgpt.checkpoint.megatron.keys import LOCAL_NORM_NAMES
from dtgpt.checkpoint.megatron.per_rank_optim import param_class, parameters
from dtgpt.config import Config

LOCAL_LAYER_ORDER = [LOCAL_NORM_NAMES.get(key, key) for key in LAYER_SPECS["local"].order if key not in MLA_KEYS]
"""A dense layer's parameters in megatron-core's module order under the local spec, by the names
the per-rank files give them."""
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")


def _place(key: str) -> tuple[int, int, int, int] | None:
    """Where megatron-core's named_parameters puts `key` (an _extra_state after its module's
    weight), or None outside a dense GPT."""
    if key.endswith("._extra_state"):
        place = _place(key.removesuffix("._extra_state") + ".weight")
        return place and (*place[:3], 1)
    if key in BEFORE or key in AFTER:
        return (0, BEFORE.index(key), 0, 0) if key in BEFORE else (2, AFTER.index(key), 0, 0)
    match = LAYER.match(key)
    if match and match.group(2) in LOCAL_LAYER_ORDER:
        return 1, int(match.group(1)), LOCAL_LAYER_ORDER.index(match.group(2)), 0
    return None


def in_megatron_order(model: dict) -> dict | None:
    """A file's model in megatron-core's module order (what its optimizer numbers the parameters
    by, and what per_rank_optim.py reads an index by), or None where a key is outside the dense
    GPT that order knows (multi-latent attention, MoE, MTP blocks): then no optimizer is written."""
    places = {key: _place(key) for key in model}
    if any(place is None for place in places.values()):
        return None
    return {key: model[key] for key in sorted(model, key=places.__getitem__)}


def _classes(decoupled: bool) -> list[tuple[bool, bool]]:
    """(no weight decay, decoupled) of each group, in megatron_optimizer_common's group order."""
    return [(False, False), *([(False, True)] if decoupled else []), (True, False)]


def per_rank_optimizer(model: dict, slots: dict[str, dict], cfg: Config, groups: list[dict]) -> dict:
    """The optimizer entry of one file: `model` its weights (fp32), `slots` {"exp_avg",
    "exp_avg_sq"} -> the same keys, `groups` megatron_optimizer_common's param groups (each
    with the Adam step, which torch keeps per parameter)."""
    decoupled = cfg.optimizer.decoupled_lr is not None
    members: dict[tuple[bool, bool], list[str]] = {c: [] for c in _classes(decoupled)}
    for key, value in parameters(model):
        members[param_class(key, value, decoupled)].append(key)
    state, param_groups, masters, index = {}, [], [], 0
    for group, c in zip(groups, _classes(decoupled)):
        keys = members[c]
        for i, key in enumerate(keys, start=index):
            state[i] = {"step": torch.tensor(float(group["step"])), "exp_avg": slots["exp_avg"][key], "exp_avg_sq": slots["exp_avg_sq"][key]}
        param_groups.append({**{k: v for k, v in group.items() if k != "step"}, "params": list(range(index, index + len(keys)))})
        masters.append([model[key].float() for key in keys])
        index += len(keys)
    adam = {"state": state, "param_groups": param_groups}
    if cfg.training.bf16 or cfg.training.fp16:
        return {"optimizer": adam, "fp32_from_fp16_params": masters}
    return adam
