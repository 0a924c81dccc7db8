"""Closed forms for the size of a GPT: its parameters and its training FLOPs per token."""

from __future__ import annotations

from dtgpt.config import ModelConfig


def num_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Closed-form parameter count of the full model (tied head counted once)."""
    h, f, L, hd = cfg.hidden_size, cfg.ffn_size, cfg.num_layers, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.query_groups * hd  # query and key (or value) widths

    def norm(size: int) -> int:
        return 2 * size if cfg.normalization == "LayerNorm" else size

    def linear(inputs: int, outputs: int, bias: bool) -> int:
        return inputs * outputs + (outputs if bias else 0)

    bias = cfg.add_bias_linear
    attention = linear(h, q + 2 * kv, cfg.qkv_bias) + linear(q, h, bias) + (2 * norm(hd) if cfg.qk_layernorm else 0)

    def mlp(width: int) -> int:
        return (2 if cfg.swiglu else 1) * linear(h, width, bias) + linear(width, h, bias)

    def block(index: int) -> int:
        if not cfg.is_moe_layer(index):
            return 2 * norm(h) + attention + mlp(f)
        shared = cfg.moe_shared_expert_intermediate_size
        moe = linear(h, cfg.num_experts, bias) + cfg.num_experts * mlp(cfg.expert_ffn_size) + (mlp(shared) if shared else 0)
        return 2 * norm(h) + attention + moe

    embed = vocab_size * h + (cfg.max_positions * h if cfg.position_embedding_type == "learned_absolute" else 0)
    head = 0 if not cfg.untie_embeddings_and_output_weights else vocab_size * h
    return sum(block(i) for i in range(L)) + embed + norm(h) + head


def flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    """Training FLOPs per token: Megatron-LM's `num_floating_point_operations` divided by tokens.

    That is Narayanan et al. (2021)'s 72·L·h²·(1 + s/(6h) + V/(12·L·h)) generalised to any MLP
    width, grouped-query attention and SwiGLU: forward + backward (3x) of the QKV, output and MLP
    matmuls (2 FLOPs per multiply-add), the s×s attention scores and values counted in full (no
    causal discount), and the logit layer. Recomputation is not counted (it is extra work, not
    useful FLOPs). An MoE layer's MLP term is, as Megatron's, its topk experts' widths plus the
    shared expert's (the router's small matmul left out).
    """
    return sum(layer_flops_per_token(cfg, i) for i in range(cfg.num_layers)) + 6 * cfg.hidden_size * vocab_size


def layer_flops_per_token(cfg: ModelConfig, index: int = 0) -> float:
    """Forward + backward FLOPs of block `index` per token (a per-layer term of flops_per_token)."""
    h, s = cfg.hidden_size, cfg.seq_length
    query_width = cfg.num_attention_heads * cfg.head_dim / h
    attention = (1 + cfg.query_groups / cfg.num_attention_heads + s / h) * query_width
    width = cfg.ffn_size
    if cfg.is_moe_layer(index):
        width = cfg.moe_router_topk * cfg.expert_ffn_size + (cfg.moe_shared_expert_intermediate_size or 0)
    mlp = width / h * (1.5 if cfg.swiglu else 1.0)
    return 12 * h * h * (attention + mlp)
