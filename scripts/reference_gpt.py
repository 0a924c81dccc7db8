"""The plain single-file GPT that scripts/bench.py times dtgpt against, the weight copy that
lets tests/test_bench.py check the two compute the same thing, and the pinned reference
trajectory of tests/test_trajectory.py.

What one would write by hand: pre-LN blocks, learned positions, fused QKV, tanh-GeLU MLP,
biases, final LayerNorm, a head tied to the embedding, GPT-2's init with residual scaling, and a
forward that takes tokens and labels and returns the mean cross-entropy.

Run as a script, it trains that model for 20 iterations with a plain loop (whole global batch
at once, AdamW, clipping, warmup + cosine LR written out here) on dtgpt's data order, from
dtgpt's documented initial values (N(0, std) drawn per parameter name), and writes the losses:

    python scripts/reference_gpt.py tests/data/reference_trajectory.json

Nothing of dtgpt's model, loss or step runs: a bug shared by every dtgpt layout (the loss
normaliser, init, optimizer groups) shows as a departure from this file's numbers.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import dtgpt
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
    """Give the reference dtgpt's weights."""
    load_dtgpt_named(ref, dict(src.named_parameters()), src.cfg.num_attention_heads)


@torch.no_grad()
def load_dtgpt_named(ref: ReferenceGPT, values: dict[str, torch.Tensor], heads: int) -> None:
    """Load tensors named as dtgpt names its parameters. dtgpt's QKV rows are
    [head, (q|k|v), head_dim]; the reference's are [(q|k|v), head, head_dim], so those rows are
    regrouped."""
    C = ref.tok.weight.shape[1]
    nh, hd = heads, C // heads
    value = {
        "tok.weight": values["embedding.word.weight"],
        "pos.weight": values["embedding.position.weight"],
        "ln_f.weight": values["norm.weight"],
        "ln_f.bias": values["norm.bias"],
    }
    for i in range(len(ref.blocks)):
        d = f"layers.{i}."
        for ours, theirs in (("ln1", "input_norm"), ("out", "attention.proj"), ("ln2", "mlp_norm"),
                             ("up", "mlp.fc1"), ("down", "mlp.fc2")):  # fmt: skip
            value[f"blocks.{i}.{ours}.weight"] = values[d + theirs + ".weight"]
            value[f"blocks.{i}.{ours}.bias"] = values[d + theirs + ".bias"]
        value[f"blocks.{i}.qkv.weight"] = values[d + "attention.qkv.weight"].view(nh, 3, hd, C).transpose(0, 1).reshape(3 * C, C)
        value[f"blocks.{i}.qkv.bias"] = values[d + "attention.qkv.bias"].view(nh, 3, hd).transpose(0, 1).reshape(3 * C)
    names = [name for name, _ in ref.named_parameters()]
    if sorted(names) != sorted(value):
        raise ValueError(f"parameter names differ: {sorted(set(names) ^ set(value))}")
    for name, p in ref.named_parameters():
        p.copy_(value[name])


# -- the pinned trajectory ---------------------------------------------------------------------

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 4, 64, 4, 32, 128
SEED, STD, BATCH, ITERS = 1234, 0.02, 8, 20
LR, WARMUP_ITERS, WEIGHT_DECAY, BETAS, EPS, CLIP = 3e-3, 2, 0.01, (0.9, 0.999), 1e-8, 1.0
DTGPT_OVERRIDES = [
    f"--model.num_layers={LAYERS}", f"--model.hidden_size={HIDDEN}", f"--model.num_attention_heads={HEADS}",
    f"--model.seq_length={SEQ}", "--model.hidden_dropout=0.0", "--model.attention_dropout=0.0",
    "--model.make_vocab_size_divisible_by=64", "--training.micro_batch_size=1",
    f"--training.global_batch_size={BATCH}", f"--training.train_iters={ITERS}", f"--training.seed={SEED}",
    f"--optimizer.lr={LR}", f"--optimizer.lr_warmup_iters={WARMUP_ITERS}", "--optimizer.lr_decay_style=cosine",
    "--optimizer.min_lr=0.0", f"--optimizer.weight_decay={WEIGHT_DECAY}", f"--optimizer.clip_grad={CLIP}",
    "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", f"--data.vocab_size={VOCAB}",
    "--data.num_workers=0", "--eval.eval_iters=0",
]  # fmt: skip
"""The same run for train.py (micro-batches of 1: dtgpt accumulates 8 where this loop takes one batch)."""


def dtgpt_initial_values(ref: ReferenceGPT) -> dict[str, torch.Tensor]:
    """dtgpt's documented init, by its parameter names: N(0, std) from a generator seeded with
    seed * 1000003 + crc32(name) (std / sqrt(2 L) for the projections into the residual), norm
    weights one, biases zero; the tied head is the embedding."""
    values = {}
    for i in range(LAYERS):
        block = ref.blocks[i]
        shapes = {"attention.qkv": block.qkv, "attention.proj": block.out, "mlp.fc1": block.up, "mlp.fc2": block.down}
        for name, linear in shapes.items():
            std = STD / math.sqrt(2 * LAYERS) if name in ("attention.proj", "mlp.fc2") else STD
            values[f"layers.{i}.{name}.weight"] = _normal(f"layers.{i}.{name}.weight", linear.weight.shape, std)
            values[f"layers.{i}.{name}.bias"] = torch.zeros(linear.bias.shape)
        for norm in ("input_norm", "mlp_norm"):
            values[f"layers.{i}.{norm}.weight"], values[f"layers.{i}.{norm}.bias"] = torch.ones(HIDDEN), torch.zeros(HIDDEN)
    values["embedding.word.weight"] = _normal("embedding.word.weight", (VOCAB, HIDDEN), STD)
    values["embedding.position.weight"] = _normal("embedding.position.weight", (SEQ, HIDDEN), STD)
    values["norm.weight"], values["norm.bias"] = torch.ones(HIDDEN), torch.zeros(HIDDEN)
    return values


def _normal(name: str, shape, std: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed((SEED * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def learning_rate(iteration: int) -> float:
    """Linear warmup from 0, then cosine to 0 over the whole run (Megatron's, per iteration)."""
    if iteration <= WARMUP_ITERS:
        return LR * iteration / WARMUP_ITERS
    progress = (iteration - WARMUP_ITERS) / (ITERS - WARMUP_ITERS)
    return LR * 0.5 * (math.cos(math.pi * progress) + 1.0)


def train_reference() -> list[float]:
    torch.manual_seed(SEED)
    model = ReferenceGPT(LAYERS, HIDDEN, HEADS, SEQ, VOCAB)
    load_dtgpt_named(model, dtgpt_initial_values(model), HEADS)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": WEIGHT_DECAY}, {"params": vectors, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, foreach=False,
    )  # fmt: skip
    # The data: dtgpt's global order of mock samples (the data order is checked against megatron-core elsewhere).
    cfg = dtgpt.make_config(
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        model=dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ),
        training=dict(micro_batch_size=1, global_batch_size=BATCH, train_iters=ITERS, seed=SEED),
    )
    batches = dtgpt.build_train_iterator(cfg, dtgpt.init_distributed(cfg).dims)  # one process: its mesh
    losses = []
    for iteration in range(ITERS):
        batch = next(batches)
        loss = model(batch.tokens, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(iteration)
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    out = Path(sys.argv[1])
    record = {
        "command": "python scripts/reference_gpt.py " + sys.argv[1],
        "torch": torch.__version__,
        "dtgpt_overrides": DTGPT_OVERRIDES,
        "losses": train_reference(),
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
