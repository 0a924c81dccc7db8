"""Layout-invariant dropout (`model.dropout_rng = "layout_invariant"`): a mask element is a function
of what it drops, not of which rank draws it.

Megatron's RNG (dtgpt/parallel/rng.py) draws masks from per-rank generator streams, so the masks
depend on the layout and parity with one process holds only without dropout. Here each keep/drop
decision is a counter-based hash of

    hidden dropout     (seed, site, token, hidden index)
    attention dropout  (seed, site, token of the query, global head, position of the key)

where `site` is the dropout's module name (global under pipelining: "layers.3.mlp_dropout"), and
`token` the token's index in the whole run, global sample number * seq_length + position in the
sample (dtgpt.step builds it from the consumed-samples count: the samples of iteration k, so no
iteration counter is needed). Every layout decides alike for the same element, whatever share it
holds: a tp rank its heads or its sequence-parallel chunk, a cp rank its two chunks, a pp stage
its layers and micro-batches, a dp rank its samples. Recomputation redraws the same mask (there
is no generator state to replay), and a resumed run the masks an uninterrupted one would draw.

The hash is MurmurHash3_x86_32 of those words (dtgpt/counter_hash.py). The cost
over Megatron's RNG: int64 keys of the mask's size while it is drawn, and attention dropout
computes softmax(q k^T) v explicitly instead of calling a fused kernel.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dtgpt.attention_varlen import document_tensor
from dtgpt.counter_hash import token_hash
from dtgpt.model import GPT, CoreAttention, allowed_keys
from dtgpt.mtp import named_blocks
from dtgpt.parallel.context import ContextParallelAttention

def keep_mask(p: float, seed: int, site: str, token_index: torch.Tensor, *coordinates: torch.Tensor) -> torch.Tensor:
    """Keep decisions (True with probability 1 - p), one per element of the broadcast of
    token_index (int64, any value >= 0) and the coordinates (int64, < 2^32), in that order."""
    return token_hash(seed, site, token_index, *coordinates) >= round(p * 2**32)


def _require_token_index(token_index: torch.Tensor | None) -> torch.Tensor:
    if token_index is None:
        raise ValueError("layout-invariant dropout needs the model's token_index input (dtgpt.step.rank_batch builds it)")
    return token_index


class InvariantDropout(nn.Module):
    """Hidden dropout keyed on (seed, site, token, hidden index).

    Under sequence parallelism the input is this tp rank's chunk of the sequence (`chunk` of
    `chunks`), so it keys on that chunk of token_index.
    """

    def __init__(self, p: float, seed: int, site: str, chunk: int = 0, chunks: int = 1):
        super().__init__()
        self.p, self.seed, self.site, self.chunk, self.chunks = p, seed, site, chunk, chunks

    def forward(self, x: torch.Tensor, token_index: torch.Tensor | None = None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        tokens = _require_token_index(token_index).chunk(self.chunks, dim=1)[self.chunk]  # (B, T_local)
        hidden = torch.arange(x.shape[-1], device=x.device)
        keep = keep_mask(self.p, self.seed, self.site, tokens[..., None], hidden)  # (B, T_local, C)
        return x * keep / (1.0 - self.p)


def dropped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) over the allowed keys, dropped by `keep` (scaled by 1/(1-p)), times v:
    what scaled_dot_product_attention computes, with a given mask. Softmax in fp32."""
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each k/v head serves `groups` query heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, nh, Tq, Tk)
    probs = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs * keep / (1.0 - p)).to(v.dtype) @ v  # (B, nh, Tq, hd)


class InvariantAttention(nn.Module):
    """The attention core with attention dropout keyed on (seed, site, query token, global head,
    key position), wrapping the core it replaces (`inner`: CoreAttention, or under context
    parallelism ContextParallelAttention, whose gathered keys it attends over). Without dropout
    (evaluation) the inner core runs as it is, on CUDA through the varlen kernel where documents
    or cp take it; in training always the masked path here (the kernel has no dropout).

    head_offset: the global index of this rank's first head (tp rank * local heads).
    """

    def __init__(self, p: float, seed: int, site: str, head_offset: int, inner: CoreAttention | ContextParallelAttention):
        super().__init__()
        self.p, self.seed, self.site, self.head_offset = p, seed, site, head_offset
        self.inner = inner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids=None, token_index=None, sink=None) -> torch.Tensor:
        """As CoreAttention.forward, with attention dropout keyed on token_index (no sink: config
        validation refuses one beside this dropout)."""
        if not self.training:
            return self.inner(q, k, v, document_ids=document_ids)
        if isinstance(self.inner, ContextParallelAttention):
            k, v = self.inner.gather(k, dim=2), self.inner.gather(v, dim=2)  # (B, nh, T, hd)
            key_positions = self.inner.key_indices(q.shape[2], q.device)
            allowed = self.inner.allowed(q.shape[2], document_ids, q.device)
        else:
            key_positions = torch.arange(k.shape[2], device=q.device)
            documents = document_tensor(document_ids)
            allowed = allowed_keys(key_positions, key_positions, documents, documents)
        heads = torch.arange(self.head_offset, self.head_offset + q.shape[1], device=q.device)
        tokens = _require_token_index(token_index)[:, None, :, None]  # (B, 1, Tq, 1)
        keep = keep_mask(self.p, self.seed, self.site, tokens, heads[:, None, None], key_positions)  # (B, nh, Tq, Tk)
        return dropped_attention(q, k, v, allowed, keep, self.p)


def apply_invariant_dropout(
    model: GPT, seed: int, tp_rank: int = 0, tp: int = 1, sequence_parallel: bool = False
) -> None:
    """Swap every dropout and attention core of `model` (a whole GPT or a stage; after TP and CP,
    before recomputation wraps the cores) for the layout-invariant ones, in place."""
    chunk, chunks = (tp_rank, tp) if sequence_parallel else (0, 1)
    for name, block in named_blocks(model).items():  # the prediction modules' blocks too
        for attr in ("dropout", "mlp_dropout"):
            site = f"{name}.{attr}"
            setattr(block, attr, InvariantDropout(getattr(block, attr).p, seed, site, chunk, chunks))
        core = block.attention.core
        if not isinstance(core, (CoreAttention, ContextParallelAttention)):
            raise TypeError("apply_invariant_dropout must run before recomputation wraps the attention core")
        if model.cfg.attention_dropout > 0.0:
            site, head_offset = f"{name}.attention.core", tp_rank * (model.cfg.num_attention_heads // tp)
            block.attention.core = InvariantAttention(model.cfg.attention_dropout, seed, site, head_offset, core)
    if model.embedding is not None:
        # The embedding's dropout runs on the full sequence, before a sequence-parallel split.
        model.embedding.dropout = InvariantDropout(model.embedding.dropout.p, seed, "embedding.dropout")
