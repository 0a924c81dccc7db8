"""Closed forms for the size of a GPT: its parameters and its training FLOPs per token."""

from __future__ import annotations

from dtgpt.config import ModelConfig


def num_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Closed-form parameter count of the full model (tied head counted once)."""
    h, f, L = cfg.hidden_size, cfg.ffn_size, cfg.num_layers
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    block = 2 * norm + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    embed = vocab_size * h + (cfg.max_positions * h if cfg.position_embedding_type == "learned_absolute" else 0)
    head = 0 if not cfg.untie_embeddings_and_output_weights else vocab_size * h
    return L * block + embed + norm + head


def flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    """Training FLOPs per token: Megatron-LM's `num_floating_point_operations` divided by tokens.

    That is Narayanan et al. (2021)'s 72·L·h²·(1 + s/(6h) + V/(12·L·h)) generalised to any MLP
    width: forward + backward (3x) of the QKV, output and MLP matmuls (2 FLOPs per multiply-add),
    the s×s attention scores and values counted in full (no causal discount), and the logit layer.
    Recomputation is not counted (it is extra work, not useful FLOPs).
    """
    h, L, s = cfg.hidden_size, cfg.num_layers, cfg.seq_length
    per_layer = 12 * h * h * (2 + s / h + cfg.ffn_size / h)
    return L * per_layer + 6 * h * vocab_size
