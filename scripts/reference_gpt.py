"""The plain single-file GPT that scripts/bench.py times dtgpt against, and the weight copy
that lets tests/test_bench.py check the two compute the same thing.

What one would write by hand: pre-LN blocks, learned positions, fused QKV, tanh-GeLU MLP,
biases, final LayerNorm, a head tied to the embedding, GPT-2's init with residual scaling, and a
forward that takes tokens and labels and returns the mean cross-entropy.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtgpt.model import GPT


class RefBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)  # rows [q | k | v], each head by head
        self.out = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class ReferenceGPT(nn.Module):
    """GPT-2/3 style: the forward takes tokens and next-token labels and returns the mean loss."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int, eps: float = 1e-5):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(RefBlock(hidden, heads, eps) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():  # LayerNorm weights keep their ones
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim >= 2:
                scaled = name.endswith(("out.weight", "down.weight"))  # GPT-2's residual scaling
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if scaled else 0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(T, device=tokens.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())



@torch.no_grad()
def copy_dtgpt_weights(src: GPT, ref: ReferenceGPT) -> None:
    """Give the reference dtgpt's weights. dtgpt's QKV rows are [head, (q|k|v), head_dim]; the
    reference's are [(q|k|v), head, head_dim], so those rows are regrouped."""
    C = src.cfg.hidden_size
    nh = src.cfg.num_attention_heads
    hd = C // nh
    value = {
        "tok.weight": src.embedding.word.weight,
        "pos.weight": src.embedding.position.weight,
        "ln_f.weight": src.norm.weight,
        "ln_f.bias": src.norm.bias,
    }
    for i, block in src.layers.items():
        attn = block.attention
        for ours, theirs in (("ln1", block.input_norm), ("out", attn.proj), ("ln2", block.mlp_norm),
                             ("up", block.mlp.fc1), ("down", block.mlp.fc2)):  # fmt: skip
            value[f"blocks.{i}.{ours}.weight"] = theirs.weight
            value[f"blocks.{i}.{ours}.bias"] = theirs.bias
        value[f"blocks.{i}.qkv.weight"] = attn.qkv.weight.view(nh, 3, hd, C).transpose(0, 1).reshape(3 * C, C)
        value[f"blocks.{i}.qkv.bias"] = attn.qkv.bias.view(nh, 3, hd).transpose(0, 1).reshape(3 * C)
    names = [name for name, _ in ref.named_parameters()]
    if sorted(names) != sorted(value):
        raise ValueError(f"parameter names differ: {sorted(set(names) ^ set(value))}")
    for name, p in ref.named_parameters():
        p.copy_(value[name])
