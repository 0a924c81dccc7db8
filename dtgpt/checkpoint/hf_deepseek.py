"""The Hugging Face DeepSeek-V3 layout (DeepseekV3ForCausalLM), to and from dtgpt names; its
config.json and the models it holds: hf_deepseek_config.py.

- Multi-latent attention maps one to one, rows unchanged: linear_q_down_proj -> q_a_proj,
  q_layernorm -> q_a_layernorm, linear_q_up_proj -> q_b_proj (or linear_q_proj -> q_proj),
  linear_kv_down_proj -> kv_a_proj_with_mqa (rows [compressed kv | the shared RoPE key] in both),
  kv_layernorm -> kv_a_layernorm, linear_kv_up_proj -> kv_b_proj (per head [no-RoPE key | value]
  in both), linear_proj -> o_proj. Each query head's rows are [no-RoPE | RoPE] in both.
- A dense block's MLP: gate -> gate_proj, fc1 -> up_proj, fc2 -> down_proj. An MoE block's
  router -> mlp.gate (the expert bias -> gate.e_score_correction_bias), the shared expert ->
  shared_experts, and each expert as DeepSeek publishes it, mlp.experts.<e>.{gate,up,down}_proj:
  dtgpt's fc1_weight[e] holds [gate; up]. transformers 5's fused experts.gate_up_proj (the same
  [gate; up] rows) and experts.down_proj are read too.
- Prediction module k is layer num_hidden_layers + k, as in DeepSeek's checkpoints: enorm, hnorm,
  eh_proj (columns [embedding | hidden] in both), the block's tensors, shared_head.norm (dtgpt's
  final_layernorm) and copies of the shared embedding and head (embed_tokens, shared_head.head),
  which an import checks against the model's own.
"""

from __future__ import annotations

import torch

from dtgpt.checkpoint import hf_deepseek_config as settings
from dtgpt.checkpoint.hf_files import HFLayout, Named, Tensors, top_from_hf, top_to_hf
from dtgpt.config import ModelConfig
from dtgpt.model import OUTPUT_WEIGHT, WORD_EMBEDDING

LM_HEAD = "lm_head.weight"

_TOP = {WORD_EMBEDDING: "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_ATTENTION = {
    "input_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_LORA_QUERY = {
    "attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
}
_QUERY = {"attention.linear_q_proj.weight": "self_attn.q_proj.weight"}
_DENSE = {"mlp.gate.weight": "mlp.gate_proj.weight", "mlp.fc1.weight": "mlp.up_proj.weight", "mlp.fc2.weight": "mlp.down_proj.weight"}
_MOE = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_expert.gate.weight": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_expert.fc1.weight": "mlp.shared_experts.up_proj.weight",
    "mlp.shared_expert.fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_PREDICTION = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "final_layernorm.weight": "shared_head.norm.weight"}  # fmt: skip
_SHARED_COPIES = {WORD_EMBEDDING: "embed_tokens.weight", OUTPUT_WEIGHT: "shared_head.head.weight"}


def _check(m: ModelConfig) -> None:
    problems = settings.deepseek_problems(m)
    if problems:
        raise ValueError(f"{settings.ARCHITECTURE} needs " + ", ".join(problems))


def _block_names(m: ModelConfig, moe: bool) -> dict[str, str]:
    """dtgpt name -> DeepseekV3 name of a block's tensors, but the experts'."""
    names = {**_ATTENTION, **(_QUERY if m.q_lora_rank is None else _LORA_QUERY)}
    return {**names, **(_MOE if moe else _DENSE)}


def _block_to_hf(model: Tensors, src: str, dst: str, m: ModelConfig, moe: bool) -> Tensors:
    out = {}
    for ours, hf in _block_names(m, moe).items():
        if ours == "mlp.router.expert_bias" and src + ours not in model:
            out[dst + hf] = torch.zeros(m.num_experts)  # no expert bias: the same choice
        else:
            out[dst + hf] = model[src + ours]
    if moe:
        width = m.expert_ffn_size
        for e, (fc1, fc2) in enumerate(zip(model[src + "mlp.experts.fc1_weight"], model[src + "mlp.experts.fc2_weight"])):
            expert = f"{dst}mlp.experts.{e}."
            out.update({expert + "gate_proj.weight": fc1[:width], expert + "up_proj.weight": fc1[width:], expert + "down_proj.weight": fc2})
    return out


def _block_from_hf(hf: Named, src: str, dst: str, m: ModelConfig, moe: bool) -> Tensors:
    model = {dst + ours: hf[src + name] for ours, name in _block_names(m, moe).items()}
    if moe:
        experts = src + "mlp.experts."
        if experts + "gate_up_proj" in hf:  # transformers 5's fused form
            model[dst + "mlp.experts.fc1_weight"], model[dst + "mlp.experts.fc2_weight"] = hf[experts + "gate_up_proj"], hf[experts + "down_proj"]
        else:
            each = [f"{experts}{e}." for e in range(m.num_experts)]
            model[dst + "mlp.experts.fc1_weight"] = torch.stack([torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]]) for e in each])
            model[dst + "mlp.experts.fc2_weight"] = torch.stack([hf[e + "down_proj.weight"] for e in each])
    return model


def to_deepseek(model: Tensors, m: ModelConfig) -> Tensors:
    """dtgpt model state (full tensors, tied head stored once) -> DeepseekV3 tensors."""
    _check(m)
    out = top_to_hf(model, _TOP, LM_HEAD, m)
    for i in range(m.num_layers):
        out.update(_block_to_hf(model, f"layers.{i}.", f"model.layers.{i}.", m, m.is_moe_layer(i)))
    head = model[OUTPUT_WEIGHT] if m.untie_embeddings_and_output_weights else model[WORD_EMBEDDING]
    for k in range(m.mtp_depth):
        src, dst = f"mtp.layers.{k}.", f"model.layers.{m.num_layers + k}."
        out.update(_block_to_hf(model, src + "transformer_layer.", dst, m, m.is_moe_layer(m.num_layers - 1)))
        out.update({dst + hf: model[src + ours] for ours, hf in _PREDICTION.items()})
        # copies: safetensors stores no tensor twice
        out.update({dst + _SHARED_COPIES[WORD_EMBEDDING]: model[WORD_EMBEDDING].clone(), dst + _SHARED_COPIES[OUTPUT_WEIGHT]: head.clone()})
    return {k: v.contiguous() for k, v in out.items()}


def from_deepseek(tensors: Tensors, m: ModelConfig, vocab_size: int) -> Tensors:
    """DeepseekV3 tensors -> dtgpt model state; the word embedding is zero-padded to `vocab_size` rows."""
    _check(m)
    hf = Named(tensors, "DeepseekV3")
    model = top_from_hf(hf, _TOP, LM_HEAD, m, vocab_size)
    for i in range(m.num_layers):
        model.update(_block_from_hf(hf, f"model.layers.{i}.", f"layers.{i}.", m, m.is_moe_layer(i)))
    head = hf[LM_HEAD] if m.untie_embeddings_and_output_weights else hf[_TOP[WORD_EMBEDDING]]
    shared = {WORD_EMBEDDING: hf[_TOP[WORD_EMBEDDING]], OUTPUT_WEIGHT: head}
    for k in range(m.mtp_depth):
        src, dst = f"model.layers.{m.num_layers + k}.", f"mtp.layers.{k}."
        model.update(_block_from_hf(hf, src, dst + "transformer_layer.", m, m.is_moe_layer(m.num_layers - 1)))
        model.update({dst + ours: hf[src + name] for ours, name in _PREDICTION.items()})
        for ours, name in _SHARED_COPIES.items():  # dtgpt's prediction modules share the model's own
            if src + name in hf and not torch.equal(hf[src + name], shared[ours]):
                raise ValueError(f"the DeepseekV3 weights' {src + name} differs from the model's own ({_TOP.get(ours, LM_HEAD)}): "
                                 "dtgpt's prediction modules share the embedding and the output head")  # fmt: skip
    return {k: v.contiguous() for k, v in model.items()}


LAYOUT = HFLayout(settings.ARCHITECTURE, "deepseek_v3", settings.deepseek_problems, to_deepseek, from_deepseek,
                  settings.deepseek_config, settings.deepseek_overrides, holds_experts=True)  # fmt: skip
