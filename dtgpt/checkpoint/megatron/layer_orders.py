"""megatron-core's grad-buffer facts by parameter key: the order a GPT layer registers its
parameters in and the ones it keeps whole on every tp rank (by layer spec, multi-head or
multi-latent attention), the model's parameters before and after the layers, and the dimension
each is split over tp ranks. buckets.py places them in the buffer; write_per_rank_optim.py writes them.
"""

from __future__ import annotations

from typing import NamedTuple

from dtgpt.checkpoint.megatron.bucket_blocks import generic
from dtgpt.checkpoint.megatron.expert_buckets import EXPERTS

_ATTENTION = ("self_attention.core_attention.softmax_offset", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_INPUT_NORM = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias")
_MLA_INPUT_NORM = ("input_layernorm.weight", "input_layernorm.bias")  # a module of its own before MLA, under either spec
_MLA_LOCAL = ("self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.weight",
              "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.weight")  # fmt: skip
MLA_TE = ("self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
           "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.layer_norm_bias",
           "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
           "self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.layer_norm_bias",
           "self_attention.linear_kv_up_proj.weight")  # fmt: skip
"""Multi-latent attention's projections after linear_proj (q_proj with no q_lora_rank, else q down
and up), by spec: the local spec's compressed-vector norms are modules after them (in _REST),
Transformer Engine's fused into the up-projections (each norm registered before its weight)."""
_REST = (
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "self_attention.kv_layernorm.weight", "self_attention.kv_layernorm.bias",  # MLA's, local spec
    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",  # an MoE layer's, under the Transformer Engine spec
    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    # an MoE layer's MLP: the router, the routed experts (EXPERTS: expert_buckets.py), the shared expert
    "mlp.router.weight", "mlp.router.bias", EXPERTS,
    "mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.bias",
)  # fmt: skip
MLA_DOWN_PROJECTIONS = frozenset({"decoder.layers.self_attention.linear_q_down_proj.weight",
                                  "decoder.layers.self_attention.linear_kv_down_proj.weight"})  # fmt: skip
"""Multi-latent attention's down-projections: column-parallel under the local spec (TP_DIM), a
TELinear in 'duplicated' mode under Transformer Engine's (megatron-core 0.16.1's MLASelfAttention):
whole on every tp rank, as the norms fused into the up-projections are."""


class LayerSpec(NamedTuple):
    """How a layer spec lays a GPT layer into the grad buffer: its parameters in megatron-core's
    module order, and the ones TP_DIM splits that this spec keeps whole on every tp rank."""

    order: tuple[str, ...]
    whole: frozenset[str] = frozenset()

    def tp_dim(self, key: str) -> int | None:
        """The dimension this spec splits parameter `key` over tp ranks, or None: whole on each."""
        return None if generic(key) in self.whole else TP_DIM.get(generic(key))


MLA_KEYS = frozenset(_MLA_INPUT_NORM + _MLA_LOCAL + MLA_TE + ("self_attention.kv_layernorm.weight", "self_attention.kv_layernorm.bias"))
BEFORE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
FINAL_NORM = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias")
AFTER = (*FINAL_NORM, "output_layer.weight")  # the MTP depths between the final norm and the head (bucket_blocks.py)
BUFFERS = ("decoder.layers.mlp.router.expert_bias",)  # saved with the model, outside the optimizer (by generic key)
TIED_HEAD = "output_layer.weight"  # at pp > 1 the last stage's copy of a tied embedding: never read
MTP_EMBEDDING_COPY = "mtp embedding copy"  # at pp > 1 the last stage's word embedding for its MTP block: never read

TP_DIM = {
    "embedding.word_embeddings.weight": 0, "output_layer.weight": 0,  # vocabulary-parallel rows
    "decoder.layers.self_attention.linear_qkv.weight": 0, "decoder.layers.self_attention.linear_qkv.bias": 0,
    "decoder.layers.mlp.linear_fc1.weight": 0, "decoder.layers.mlp.linear_fc1.bias": 0,  # column-parallel
    "decoder.layers.self_attention.linear_proj.weight": 1, "decoder.layers.mlp.linear_fc2.weight": 1,  # row-parallel
    "decoder.layers.self_attention.core_attention.softmax_offset": 0,  # the attention sink's logits, by head
    "decoder.layers.mlp.shared_experts.linear_fc1.weight": 0, "decoder.layers.mlp.shared_experts.linear_fc1.bias": 0,
    "decoder.layers.mlp.shared_experts.linear_fc2.weight": 1,  # an MoE layer's shared expert, split as the dense MLP
    # multi-latent attention's projections are column-parallel (the down-projections under the local spec;
    # Transformer Engine's keeps them whole: LayerSpec.whole), as is an MTP depth's eh_proj
    "decoder.layers.self_attention.linear_q_proj.weight": 0, "decoder.layers.self_attention.linear_q_down_proj.weight": 0,
    "decoder.layers.self_attention.linear_q_up_proj.weight": 0, "decoder.layers.self_attention.linear_kv_down_proj.weight": 0,
    "decoder.layers.self_attention.linear_kv_up_proj.weight": 0, "mtp.layers.eh_proj.weight": 0,
}  # fmt: skip
"""The dimension megatron-core splits over tp ranks; every other parameter is whole on each. The
QKV rows need no more: whole query groups sit on each tp rank, in the global (interleaved) order."""
LAYER_SPECS = {
    "local": LayerSpec((*_INPUT_NORM, *_MLA_INPUT_NORM, *_ATTENTION, *_MLA_LOCAL, *_REST)),
    "transformer_engine": LayerSpec((*_MLA_INPUT_NORM, *_ATTENTION, *_INPUT_NORM, *MLA_TE, *_REST), MLA_DOWN_PROJECTIONS),
}
"""A GPT layer in megatron-core's grad buffer, by layer spec, with multi-head or multi-latent
attention (MLA's local order measured on megatron-core 0.16.1; a layer holds one attention's keys,
the others are absent)."""
SWIGLU_FC1 = {f"decoder.layers.mlp.{mlp}linear_fc1": f"decoder.layers.mlp.{mlp}linear_fc2.weight"
              for mlp in ("", "shared_experts.", "experts.experts.")}
"""Each linear_fc1 (weight and bias) whose rows are SwiGLU's [gate; up] when they are twice its linear_fc2's columns."""


def swiglu_keys(shapes: dict) -> set[str]:
    """The linear_fc1 weights and biases of `shapes` whose rows are [gate; up] (SWIGLU_FC1), of any block."""
    fc1s = [key.removesuffix(".weight") for key in shapes if generic(key).removesuffix(".weight") in SWIGLU_FC1]
    gated = [fc1 for fc1 in fc1s if shapes[f"{fc1}.weight"][-2] == 2 * shapes.get(fc1.removesuffix("fc1") + "fc2.weight", (0,))[-1]]
    return {f"{fc1}.{kind}" for fc1 in gated for kind in ("weight", "bias")}
