"""The key map between Megatron-LM's tensor names and dtgpt's, the full shapes, and the
vocabulary rows.

QKV rows need no reordering: Megatron interleaves them per query group, [q_1 .. q_n | k | v] of
each group, as dtgpt does. SwiGLU's two input projections are one Megatron tensor, linear_fc1,
whose full rows are [gate; fc1] (SWIGLU_HALVES); dtgpt keeps them as two.
The vocabulary rows are read as stored, never dropped or zero-padded: every row, padding
included, is in the softmax's denominator, so a model with other rows than Megatron's padding
(make_vocab_size_divisible_by x tp) would not compute Megatron's loss; the reader refuses it.
Writing pads (resize_vocab) to the rows Megatron expects at its tp.
"""

from __future__ import annotations

import re

import torch

from dtgpt.config import ModelConfig
from dtgpt.model import GPT

OPTIMIZER_PREFIX = "optimizer.state."
"""Megatron's model-space optimizer state: `optimizer.state.<slot>.<model key>`, shaped as the model key."""
MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's slots (megatron-core's and torch's AdamW name them alike)."""
MOMENTUM = "momentum_buffer"
"""Muon's slot (megatron-core's TensorParallelMuon and dtgpt's MuonWithAdamW name it alike)."""

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
    "attention.q_norm.weight": "self_attention.q_layernorm.weight",
    "attention.q_norm.bias": "self_attention.q_layernorm.bias",
    "attention.k_norm.weight": "self_attention.k_layernorm.weight",
    "attention.k_norm.bias": "self_attention.k_layernorm.bias",
    "attention.sink.softmax_offset": "self_attention.core_attention.softmax_offset",  # softmax_type='learnable'
    "attention.proj.weight": "self_attention.linear_proj.weight",
    "attention.proj.bias": "self_attention.linear_proj.bias",
    "mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp_norm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.gate.weight": "mlp.linear_fc1.weight",
    "mlp.gate.bias": "mlp.linear_fc1.bias",
    "mlp.fc1.weight": "mlp.linear_fc1.weight",
    "mlp.fc1.bias": "mlp.linear_fc1.bias",
    "mlp.fc2.weight": "mlp.linear_fc2.weight",
    "mlp.fc2.bias": "mlp.linear_fc2.bias",
    # an MoE layer (its pre-norm keeps the dense MLP's name above); Megatron's torch_dist keeps
    # the experts on a global expert axis after the layer axis, (L, E, ...), whichever expert
    # module saved them (SequentialMLP, GroupedMLP or TEGroupedMLP), and at any ep
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.experts.fc1_weight": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.fc1_bias": "mlp.experts.experts.linear_fc1.bias",
    "mlp.experts.fc2_weight": "mlp.experts.experts.linear_fc2.weight",
    "mlp.experts.fc2_bias": "mlp.experts.experts.linear_fc2.bias",
    "mlp.shared_expert.gate.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_expert.gate.bias": "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_expert.fc1.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_expert.fc1.bias": "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_expert.fc2.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_expert.fc2.bias": "mlp.shared_experts.linear_fc2.bias",
    "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight",
}
"""dtgpt block-relative name -> Megatron's (torch_dist stacks it under `decoder.layers.`)."""

MLA_LAYER_KEYS = {
    "input_norm.weight": "input_layernorm.weight",
    "input_norm.bias": "input_layernorm.bias",
    "mlp_norm.weight": "pre_mlp_layernorm.weight",
    "mlp_norm.bias": "pre_mlp_layernorm.bias",
    "attention.linear_q_proj.weight": "self_attention.linear_q_proj.weight",
    "attention.linear_q_down_proj.weight": "self_attention.linear_q_down_proj.weight",
    "attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "attention.q_layernorm.bias": "self_attention.linear_q_up_proj.layer_norm_bias",
    "attention.linear_q_up_proj.weight": "self_attention.linear_q_up_proj.weight",
    "attention.linear_kv_down_proj.weight": "self_attention.linear_kv_down_proj.weight",
    "attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
    "attention.kv_layernorm.bias": "self_attention.linear_kv_up_proj.layer_norm_bias",
    "attention.linear_kv_up_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "attention.linear_proj.bias": "self_attention.linear_proj.bias",
}
"""A multi-latent-attention block's names where they differ from LAYER_KEYS. megatron-core's MLA
layer specs keep the pre-attention norm as its own module (input_layernorm), and so the MoE
layer's pre-MLP norm (pre_mlp_layernorm); the norms of the compressed query and key/value are
fused into the up-projections by the Transformer Engine spec (what Megatron-LM runs by default,
so what torch_dist is written with), separate modules in the local spec (MLA_LOCAL_NORM_NAMES:
either is read; the per-rank files are written with the local spec's). The
up-projections' rows are the heads in turn, [q_nope | q_pe] and [k_nope | v] per head, as
dtgpt's; the down-projection's rows are [compressed | k_pe]: no reordering either way."""

MLA_LOCAL_NORM_NAMES = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_bias": "self_attention.q_layernorm.bias",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_bias": "self_attention.kv_layernorm.bias",
}
"""The norms of MLA's compressed query and key/value: Transformer Engine's fused name -> the
local layer spec's module (megatron-core's state_dict, so the per-rank files, keep the latter)."""

LOCAL_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    **MLA_LOCAL_NORM_NAMES,
}
"""A block's norms, fused name -> the local layer spec's per-layer name (the per-rank format keeps
the latter: megatron-core's sharded_state_dict_keys_map renames them for torch_dist alone)."""

STORED_ALIASES = {
    **LOCAL_NORM_NAMES,
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
"""Megatron name (after `decoder.layers.`) -> the other name the same tensor has under another
layer spec: the local spec's separate norms (the MLA ones in torch_dist too, every one in the
per-rank files); the pre-MLP norm, fused into linear_fc1 or a module of its own depending on
the spec and whether the layer is MoE. The reader takes whichever the checkpoint holds."""

BUFFERS = ("mlp.router.expert_bias",)
"""Block-relative dtgpt names that are buffers, not parameters: saved with the model, with no
optimizer state (Megatron's expert bias is a buffer too, moved outside the optimizer)."""


def is_buffer(name: str) -> bool:
    return name.endswith(BUFFERS)


EXPERT_KEY = "mlp.experts.experts."
"""The torch_dist prefix of the routed experts' tensors, (L, E, ...); the per-rank format keeps
each expert whole under `mlp.experts.local_experts.<K>.` in its expert-parallel rank's file."""

SWIGLU_HALVES = {"gate": 0, "fc1": 1}
"""With swiglu, which half of linear_fc1's rows each dtgpt projection is (the gate, activated, first);
the dense MLP's and the shared expert's alike (the routed experts keep [gate; fc1] as one tensor)."""

VOCAB_KEYS = ("embedding.word.weight", "output.weight")


MTP_PREFIX = "mtp.layers."
"""dtgpt's and Megatron's prefix of the multi-token prediction modules alike: `mtp.layers.<k>.`
holds enorm, hnorm, eh_proj and final_layernorm under their own names, and a block of the
model's kind under `transformer_layer.`, named as a decoder layer is. Megatron's torch_dist keeps
each of those tensors whole, by depth, with no layer axis."""


def _layer_key(rest: str, mla: bool) -> str:
    """A block-relative dtgpt name -> Megatron's, after the layer prefix."""
    key = MLA_LAYER_KEYS.get(rest) if mla or rest not in LAYER_KEYS else None  # the norms differ by attention
    return key or LAYER_KEYS[rest]


def megatron_name(name: str, mla: bool = False, per_layer: bool = False) -> tuple[str, int | None]:
    """dtgpt FQN -> (Megatron torch_dist key, layer index or None); `mla`: the model's blocks
    have multi-latent attention (its norms are named otherwise); `per_layer`: the checkpoint keeps
    each decoder layer under its own keys (`decoder.layers.<i>.`, see stores_per_layer) instead
    of stacking the layers on a leading axis."""
    if name in GLOBAL_KEYS:
        return GLOBAL_KEYS[name], None
    if name.startswith(MTP_PREFIX):
        depth, rest = name.removeprefix(MTP_PREFIX).split(".", 1)
        block = rest.removeprefix("transformer_layer.")
        if block != rest:
            rest = "transformer_layer." + _layer_key(block, mla)
        return f"{MTP_PREFIX}{depth}.{rest}", None
    _, layer, rest = name.split(".", 2)  # layers.<i>.<rest>
    if per_layer:
        return f"decoder.layers.{layer}.{_layer_key(rest, mla)}", None
    return "decoder.layers." + _layer_key(rest, mla), int(layer)


def stores_per_layer(cfg: ModelConfig) -> bool:
    """Whether megatron-core's torch_dist keeps model `cfg`'s decoder layers apart, as it does
    for any layer pattern other than moe_layer_freq=1 (dense and MoE layers differ in tensors)."""
    return str(cfg.moe_layer_freq).strip() != "1"


def block_of(name: str, num_layers: int) -> int | None:
    """The decoder block whose kind dtgpt tensor `name` has (an MTP block: the last one's), or None."""
    if name.startswith("layers."):
        return int(name.split(".", 2)[1])
    return num_layers - 1 if name.startswith(MTP_PREFIX) and ".transformer_layer." in name else None


def is_mla(names) -> bool:
    """Whether the model of dtgpt FQNs `names` has multi-latent attention."""
    return any(name.endswith("attention.linear_kv_down_proj.weight") for name in names)


def stored_alias(key: str) -> str | None:
    """The other name of Megatron key `key` under another layer spec (STORED_ALIASES), or None;
    a decoder layer's, stacked or not, or an MTP block's."""
    for rest, alias in STORED_ALIASES.items():
        prefix = key.removesuffix(rest)
        if prefix != key and re.fullmatch(r"decoder\.layers\.(\d+\.)?|mtp\.layers\.\d+\.transformer_layer\.", prefix):
            return prefix + alias
    return None


def half_of(name: str, names) -> int | None:
    """Which half of Megatron's linear_fc1 rows `name` is, given every name of the model
    (`names`): fc1 is the second half when its block has a gate, else the whole tensor."""
    parts = name.split(".")
    if not name.startswith(("layers.", MTP_PREFIX)) or len(parts) < 4 or parts[-2] not in SWIGLU_HALVES or ".mlp." not in name:
        return None
    if ".".join([*parts[:-2], "gate", parts[-1]]) not in names:
        return None
    return SWIGLU_HALVES[parts[-2]]


def dtgpt_names(cfg: ModelConfig) -> list[str]:
    """Every dtgpt FQN of the full model of `cfg` (a tied head's copy left out: it is the embedding)."""
    return list(full_model_shapes(cfg, cfg.make_vocab_size_divisible_by))


def full_model_shapes(cfg: ModelConfig, vocab_rows: int) -> dict[str, tuple[int, ...]]:
    """Every dtgpt tensor's full shape with a vocabulary of `vocab_rows` rows, on meta (a tied
    head's copy left out)."""
    with torch.device("meta"):
        state = GPT(cfg, vocab_rows).state_dict()
    tied = not cfg.untie_embeddings_and_output_weights
    return {name: tuple(value.shape) for name, value in state.items() if not (tied and name == "output.weight")}


def resize_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Drop or zero-pad padding rows of a vocabulary-sized tensor to `rows`."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])
