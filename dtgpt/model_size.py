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
    mlp = (2 if cfg.swiglu else 1) * linear(h, f, bias) + linear(f, h, bias)
    block = 2 * norm(h) + attention + mlp
    embed = vocab_size * h + (cfg.max_positions * h if cfg.position_embedding_type == "learned_absolute" else 0)
    head = 0 if not cfg.untie_embeddings_and_output_weights else vocab_size * h
    return L * block + embed + norm(h) + head


def flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    """Training FLOPs per token: Megatron-LM's `num_floating_point_operations` divided by tokens.

    That is Narayanan et al. (2021)'s 72·L·h²·(1 + s/(6h) + V/(12·L·h)) generalised to any MLP
    width, grouped-query attention and SwiGLU: forward + backward (3x) of the QKV, output and MLP
    matmuls (2 FLOPs per multiply-add), the s×s attention scores and values counted in full (no
    causal discount), and the logit layer. Recomputation is not counted (it is extra work, not
    useful FLOPs).
    """
    return cfg.num_layers * layer_flops_per_token(cfg) + 6 * cfg.hidden_size * vocab_size


def layer_flops_per_token(cfg: ModelConfig) -> float:
    """Forward + backward FLOPs of one block per token (the per-layer term of flops_per_token)."""
    h, s = cfg.hidden_size, cfg.seq_length
    query_width = cfg.num_attention_heads * cfg.head_dim / h
    attention = (1 + cfg.query_groups / cfg.num_attention_heads + s / h) * query_width
    mlp = cfg.ffn_size / h * (1.5 if cfg.swiglu else 1.0)
    return 12 * h * h * (attention + mlp)
