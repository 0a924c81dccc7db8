"""Activation memory, term by term: what one layer keeps for backward (Korthikanti et al. 2022).

"Reducing Activation Recomputation in Large Transformer Models", section 4, counts the bytes a
GPT layer keeps per micro-batch with 16-bit activations and 1-byte dropout masks:
34·s·b·h + 5·a·s²·b, each term divided by t under tensor parallelism with sequence parallelism.
`layer_activation_terms` writes that count out term by term, and says which terms the config
has: a dropout of p = 0 keeps no mask, a fused attention kernel (flash, memory-efficient) keeps
no a·s×s scores, recomputation drops what it recomputes, and dtgpt's sequence-parallel plan keeps
what Megatron's gathers again. tests/test_activation_memory.py measures the saved tensors of the
real model against it; docs/plan.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtgpt.config import Config, low_precision


@dataclass(frozen=True)
class ActivationShape:
    """What the activation formulas need: per micro-batch s, b, h, a, V, the layout and the regime.

    The defaults are Korthikanti's assumptions (16-bit activations, dropout everywhere, the
    unfused attention core, Megatron's sequence parallelism); `for_config` gives dtgpt's.
    """

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    num_heads: int
    padded_vocab: int
    tp: int
    sequence_parallel: bool
    ffn_size: int | None = None
    """The MLP width (None: 4h, Korthikanti's)."""
    compute_bytes: int = 2
    """e: bytes of an activation, 2 under fp16/bf16, 4 in fp32."""
    residual_bytes: int | None = None
    """The residual stream's bytes, kept as the norms' inputs (None: e; 4 with fp32_residual_connection)."""
    hidden_dropout: bool = True
    attention_dropout: bool = True
    scores_kept: bool = True
    """The attention kernel keeps the a·s×s softmax output for backward (Megatron's unfused core
    attention; torch's math SDPA kernel). A fused kernel (flash, memory-efficient; Megatron with
    flash attention) keeps only q, k, v, the output and a log-sum-exp per query, and draws its
    dropout mask again in backward: no s² term."""
    megatron_sp: bool = True
    """Megatron's sequence parallelism: a column-parallel layer (QKV, fc1, the head) keeps its
    sequence shard of the input and all-gathers it again in backward. False: dtgpt's DTensor plan,
    which keeps the gathered input, and runs the embedding's dropout before the sequence split."""
    cp: int = 1
    """Context parallelism: each rank holds seq_length / cp tokens of every sequence."""
    qkv_width: float = 3.0
    """q, k, v's channels over h: (heads + 2·groups)·head_dim / h (3 without grouped-query attention)."""
    query_width: float = 1.0
    """The attention output's channels over h: heads·head_dim / h."""
    swiglu: bool = False
    """SwiGLU keeps the gate's output, its SiLU and fc1's output besides fc2's input (GeLU: one f-wide tensor before fc2's)."""
    qk_norm_width: float = 0.0
    """qk-layernorm's inputs over h: (heads + groups)·head_dim / h (0 without)."""

    @classmethod
    def for_config(cls, cfg: Config, padded_vocab: int, tp: int, cp: int = 1, *, scores_kept: bool = True) -> "ActivationShape":
        """dtgpt's run of `cfg` on a rank of tp x cp: its dtypes, its dropouts, its SP plan."""
        m, t = cfg.model, cfg.training
        e = 2 if low_precision(cfg) else 4
        # A rank that shares a key/value group with others keeps that one group: as if tp groups.
        heads, groups = m.num_attention_heads * m.head_dim / m.hidden_size, max(m.query_groups, tp) * m.head_dim / m.hidden_size
        return cls(
            m.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads, padded_vocab, tp,
            cfg.parallel.sequence_parallel, ffn_size=m.ffn_size, compute_bytes=e,
            residual_bytes=4 if t.fp32_residual_connection else None, hidden_dropout=m.hidden_dropout > 0,
            attention_dropout=m.attention_dropout > 0, scores_kept=scores_kept, megatron_sp=False, cp=cp,
            qkv_width=heads + 2 * groups, query_width=heads, swiglu=m.swiglu,
            qk_norm_width=heads + groups if m.qk_layernorm else 0.0,
        )  # fmt: skip

    @property
    def local_tokens(self) -> float:
        return self.seq_length / self.cp

    @property
    def sbh(self) -> float:
        """Per rank: its share of the sequence (s/cp) times b and h."""
        return self.local_tokens * self.micro_batch_size * self.hidden_size

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def sp_divisor(self) -> int:
        """What divides the sequence-parallel terms (norm inputs, hidden-dropout masks): t under SP."""
        return self.tp if self.sp else 1

    @property
    def gathered_divisor(self) -> int:
        """What divides a column-parallel layer's input: t under Megatron's SP only."""
        return self.sp_divisor if self.megatron_sp else 1


def layer_activation_terms(shape: ActivationShape, recompute: str = "none") -> dict[str, float]:
    """Bytes one transformer layer keeps for backward per micro-batch on one rank, by term.

    term (kept by)                          bytes, no parallelism    under tp t
    norm inputs (the two norms)             2·r·s·b·h                /t with SP
    qkv input (the QKV matmul)              e·s·b·h                  /t with Megatron's SP (dtgpt: gathered, not)
    q, k, v (q·kᵀ and the matmul with v)    3·e·s·b·h                /t
    proj input (the output projection)      e·s·b·h                  /t
    fc1 input (the first MLP matmul)        e·s·b·h                  as the qkv input
    gelu input                              e·s·b·f                  /t
    fc2 input (the GeLU output)             e·s·b·f                  /t

    The GPT family changes the widths: with grouped-query attention q, k, v are (heads +
    2·groups)·head_dim wide and the projection's input heads·head_dim; SwiGLU keeps three f-wide
    tensors before fc2's input (the gate's output, its SiLU and fc1's output) where GeLU keeps
    one; qk-layernorm keeps its inputs, (heads + groups)·head_dim wide.
    hidden dropout masks (2, 1 byte)        2·s·b·h                  /t with SP; none at p = 0
    softmax output (the scores)             e·a·s²·b                 /t; only a kernel that keeps scores
    attention dropout mask (1 byte), output (1 + e)·a·s²·b           /t; as the scores, and none at p = 0
    cp keys and values (gathered)           2·e·s·b·h·(cp-1)         /t; without recomputation

    e = 2, r = e, f = 4h: 4 + 2 + 6 + 2 + 2 + 8 + 8 + 2 = 34·s·b·h and 2 + 1 + 2 = 5·a·s²·b, Korthikanti's
    34·s·b·h + 5·a·s²·b (without SP: 10·s·b·h + 24·s·b·h/t + 5·a·s²·b/t).
    recompute 'selective': the attention core is recomputed, so no scores and no gathered cp
    keys and values (its inputs q, k, v are kept as before). 'full': only the input of each
    recomputed group, r·s·b·h (/t with SP); the planner counts it once per group.
    With cp, s·b·h is the rank's share (s/cp tokens) while a·s²·b keeps one full s: each local
    query scores every key. Not counted (under 1% at h >= 256): the norms' statistics and a fused
    kernel's log-sum-exp, a few bytes per token.
    """
    e, t, sbh = shape.compute_bytes, shape.tp, shape.sbh
    r = shape.residual_bytes or e
    if recompute == "full":
        return {"block input": r * sbh / shape.sp_divisor}
    sbf = sbh * (shape.ffn_size or 4 * shape.hidden_size) / shape.hidden_size
    terms = {
        "norm inputs": 2 * r * sbh / shape.sp_divisor,
        "qkv input": e * sbh / shape.gathered_divisor,
        "q, k, v": shape.qkv_width * e * sbh / t,
        "proj input": shape.query_width * e * sbh / t,
        "fc1 input": e * sbh / shape.gathered_divisor,
        ("gate, silu, fc1 outputs" if shape.swiglu else "gelu input"): (3 if shape.swiglu else 1) * e * sbf / t,
        "fc2 input": e * sbf / t,
    }
    if shape.qk_norm_width:
        terms["qk-norm inputs"] = shape.qk_norm_width * e * sbh / t
    if shape.hidden_dropout:
        terms["hidden dropout masks"] = 2 * sbh / shape.sp_divisor
    scores = sbh * shape.num_heads * shape.seq_length / shape.hidden_size / t  # a·(s/cp)·s·b / t elements
    if shape.scores_kept and recompute != "selective":
        terms["softmax output"] = e * scores
        if shape.attention_dropout:
            terms["attention dropout mask, output"] = (1 + e) * scores
    if recompute == "none" and shape.cp > 1:
        terms["cp keys and values"] = 2 * e * sbh * (shape.cp - 1) / t
    return terms


def layer_activation_bytes(shape: ActivationShape, recompute: str) -> float:
    """The sum of layer_activation_terms."""
    return sum(layer_activation_terms(shape, recompute).values())


def embedding_activation_bytes(shape: ActivationShape) -> float:
    """First stage: the 1-byte dropout mask of the embedding output (s·b·h, /t under Megatron's SP;
    dtgpt drops before the sequence split); none at p = 0."""
    if not shape.hidden_dropout:
        return 0.0
    return shape.sbh / shape.gathered_divisor


def head_activation_bytes(shape: ActivationShape) -> float:
    """Last stage: final-norm input (r·s·b·h, /t under SP), the head input (e·s·b·h, as a
    column-parallel input) and the vocabulary-sharded logits: compute dtype + an fp32 copy for
    the loss + its gradient."""
    e, s, b, v, t = shape.compute_bytes, shape.local_tokens, shape.micro_batch_size, shape.padded_vocab, shape.tp
    norm_in = (shape.residual_bytes or e) * shape.sbh / shape.sp_divisor
    head_in = e * shape.sbh / shape.gathered_divisor
    logits = (e + 4 + 4) * s * b * v / t
    return norm_in + head_in + logits
