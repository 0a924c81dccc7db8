"""The GPT-3 model of Megatron-LM in plain single-device PyTorch.

Pre-LayerNorm blocks, learned absolute position embeddings (RoPE as an option), causal
attention through `scaled_dot_product_attention`, a GeLU MLP, biases everywhere, and an output
head tied to the word embedding. This file never imports torch.distributed: parallelism is
applied from the outside (dtgpt/parallel). What the model concedes to pipelining: blocks live in
an `nn.ModuleDict` keyed "0".."L-1" (names survive deleting blocks), and the embedding, final
norm and head may be None on a pipeline stage.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dtgpt.config import ModelConfig
from dtgpt.config import padded_vocab_size as padded_vocab_size  # re-exported: scripts and tests use it

WORD_EMBEDDING = "embedding.word.weight"
OUTPUT_WEIGHT = "output.weight"


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)


def apply_rotary(x: torch.Tensor, base: int) -> torch.Tensor:
    """Rotate pairs of channels of x (B, nh, T, hd) by position-dependent angles (RoPE)."""
    T, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


class Embedding(nn.Module):
    """Word embedding plus (optionally) learned positions, then dropout."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.word = nn.Embedding(vocab_size, cfg.hidden_size)
        self.position = (
            nn.Embedding(cfg.max_positions, cfg.hidden_size)
            if cfg.position_embedding_type == "learned_absolute"
            else None
        )
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.word(tokens)  # (B, T, C)
        if self.position is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.position(positions)
        return self.dropout(h)


class Attention(nn.Module):
    """Causal self-attention with a fused QKV projection.

    The QKV weight rows are laid out head by head, [head, (q|k|v), head_dim], so that cutting the
    rows into tp equal pieces gives each rank whole heads: column parallelism needs no reordering.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attention_dropout = cfg.attention_dropout
        self.rotary_base = cfg.rotary_base if cfg.position_embedding_type == "rope" else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds only its share of the heads.
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)  # (B, T, nh, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, nh, T, hd)
        if self.rotary_base:
            q, k = apply_rotary(q, self.rotary_base), apply_rotary(k, self.rotary_base)
        dropout = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.fc2 = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The tanh approximation, as GPT-2 and Megatron's fused bias-GeLU use.
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_norm = build_norm(cfg)
        self.attention = Attention(cfg)
        self.mlp_norm = build_norm(cfg)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        # Set by dtgpt.parallel.apply_ac: recompute this block's activations in backward.
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        """vocab_size is the padded vocabulary (see padded_vocab_size)."""
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embedding: Embedding | None = Embedding(cfg, vocab_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = build_norm(cfg)
        self.output: nn.Linear | None = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        self.tied = not cfg.untie_embeddings_and_output_weights
        if self.tied:
            self.output.weight = self.embedding.word.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); a pipeline stage maps whatever it holds."""
        h = self.embedding(x) if self.embedding is not None else x
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    # -- initialisation ------------------------------------------------------------------------

    def initial_value(self, name: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
        """The full initial tensor of parameter `name`, a function of (name, shape, seed) only.

        Each parameter draws from its own generator seeded by its name, so the value does not
        depend on which other parameters a rank holds or in which order they are visited.
        """
        if name == OUTPUT_WEIGHT and self.tied:
            name = WORD_EMBEDDING  # the last pipeline stage's copy of the tied weight starts equal
        leaf = name.rsplit(".", 1)[-1]
        is_norm = "norm" in name
        if leaf == "bias":
            return torch.zeros(shape, device=device)
        if is_norm:
            return torch.ones(shape, device=device)
        std = self.cfg.init_method_std
        if name.endswith(("attention.proj.weight", "mlp.fc2.weight")):
            std = std / math.sqrt(2.0 * self.cfg.num_layers)  # scaled init of output projections
        generator = torch.Generator(device=device)
        generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)

    @torch.no_grad()
    def init_weights(
        self,
        seed: int,
        device: torch.device | str = "cpu",
        assign: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """Give *every* parameter its initial value (call after `to_empty`).

        `assign(param, full_value)` writes a full tensor into a parameter that may be sharded;
        the default copies it whole.
        """
        device = torch.device(device)
        for name, param in self.named_parameters():
            value = self.initial_value(name, param.shape, seed, device)
            if assign is None:
                param.copy_(value)
            else:
                assign(param, value)


# -- counting ----------------------------------------------------------------------------------


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
