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
from dtgpt.config.recompute_rules import DEFAULT_MODULES, selective_modules


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
    latent: "LatentWidths | None" = None
    """Multi-latent attention's compressed widths (None: (grouped-query) attention); q, k, v's and
    the projection input's widths are then qkv_width and query_width as for_config sets them."""
    experts: int = 0
    """MoE layers (layer_activation_terms(moe=True)): E experts, each token sent to topk of them,
    expert_ffn wide; routed_rows_per_token: the rows each local token becomes (topk dropless,
    more when padded to capacity); shared_ffn: the shared expert's width (0: none)."""
    topk: int = 0
    expert_ffn: int = 0
    routed_rows_per_token: float = 0.0
    shared_ffn: int = 0
    shared_gate: bool = False
    ep: int = 1
    recompute_modules: tuple[str, ...] = DEFAULT_MODULES
    """What recompute 'selective' recomputes in every block (training.recompute_modules)."""

    @classmethod
    def for_config(cls, cfg: Config, padded_vocab: int, tp: int, cp: int = 1, *, scores_kept: bool = True) -> "ActivationShape":
        """dtgpt's run of `cfg` on a rank of tp x cp: its dtypes, its dropouts, its SP plan."""
        m, t = cfg.model, cfg.training
        e = 2 if low_precision(cfg) else 4
        # A rank that shares a key/value group with others keeps that one group: as if tp groups.
        heads, groups = m.num_attention_heads * m.head_dim / m.hidden_size, max(m.query_groups, tp) * m.head_dim / m.hidden_size
        attention = dict(qkv_width=heads + 2 * groups, query_width=heads, qk_norm_width=heads + groups if m.qk_layernorm else 0.0)
        if m.multi_latent_attention:  # qk_layernorm: the compressed vectors' norms, in LatentWidths
            latent = LatentWidths.for_model(m)
            attention = dict(qkv_width=latent.qkv_width, query_width=latent.query_width, qk_norm_width=0.0, latent=latent)
        return cls(
            m.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads, padded_vocab, tp,
            cfg.parallel.sequence_parallel, ffn_size=m.ffn_size, compute_bytes=e,
            residual_bytes=4 if t.fp32_residual_connection else None, hidden_dropout=m.hidden_dropout > 0,
            attention_dropout=m.attention_dropout > 0, scores_kept=scores_kept, megatron_sp=False, cp=cp,
            swiglu=m.swiglu, **attention, **_moe_fields(cfg),
            recompute_modules=selective_modules(t) if t.recompute_granularity == "selective" else DEFAULT_MODULES,
        )  # fmt: skip

    @property
    def routed_tokens(self) -> float:
        """Tokens one rank routes per micro-batch: its sequence chunk (s/cp, /t under SP) times b."""
        return self.local_tokens * self.micro_batch_size / self.sp_divisor

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


@dataclass(frozen=True)
class LatentWidths:
    """Multi-latent attention's widths over h (dtgpt/mla.py): the compressed query (0: projected
    in one), the compressed key/value, the shared RoPE key, the heads' q/k and v channels, and
    whether the compressed vectors are normed (model.qk_layernorm)."""

    q_lora: float
    kv_lora: float
    pos: float
    heads_qk: float
    """heads·(qk_head_dim + qk_pos_emb_head_dim) / h: a query's (and a key's) channels."""
    heads_v: float
    """heads·v_head_dim / h."""
    heads_kv: float
    """heads·(qk_head_dim + v_head_dim) / h: linear_kv_up_proj's output, of which v is a view."""
    norms: bool

    @classmethod
    def for_model(cls, m) -> "LatentWidths":
        h, nh = m.hidden_size, m.num_attention_heads
        return cls(q_lora=(m.q_lora_rank or 0) / h, kv_lora=m.kv_lora_rank / h, pos=m.qk_pos_emb_head_dim / h,
                   heads_qk=nh * (m.qk_head_dim + m.qk_pos_emb_head_dim) / h, heads_v=nh * m.v_head_dim / h,
                   heads_kv=nh * (m.qk_head_dim + m.v_head_dim) / h, norms=m.qk_layernorm)  # fmt: skip

    @property
    def qkv_width(self) -> float:
        return 2 * self.heads_qk + self.heads_v

    @property
    def query_width(self) -> float:
        return self.heads_v


def latent_attention_terms(shape: ActivationShape, recompute: str) -> dict[str, float]:
    """What multi-latent attention keeps in place of the qkv input and q, k, v, per micro-batch on
    one rank (Korthikanti's method applied to dtgpt/mla.py; widths over h as LatentWidths):

    term (kept by)                                 bytes            under tp t (dtgpt's plan)
    down-projections' input (both read it)         e·s·b·h          /t with SP (own tokens: replicated linears)
    compressed query: its norm's input, the        e·s·b·q_lora     /t with SP
      up-projection's input                        e·s·b·q_lora     gathered (/t with Megatron's SP)
    compressed key/value: its norm's input (a view e·s·b·(kv + pos) /t with SP
      of the down-projection's whole output), the
      up-projection's input                        e·s·b·kv         gathered (as the query's)
    q and k (RoPE'd, concatenated)                 2·e·s·b·heads_qk /t
    v                                              e·s·b·heads_v    /t; heads_kv when the core keeps
                                                                    linear_kv_up_proj's output (v a view of
                                                                    it: a fused kernel, or the recomputed core)

    Without norms the up-projections read the down-projections' outputs directly (one term each);
    without a compressed query linear_q_proj reads the down-projections' input. The shared RoPE
    key's gather keeps nothing (its rotation keeps cos and sin, a few bytes per position).
    """
    lat, e, t, sbh = shape.latent, shape.compute_bytes, shape.tp, shape.sbh
    own, gathered = shape.sp_divisor, shape.gathered_divisor
    v_view = not shape.scores_kept or core_recomputed(shape, recompute)
    terms = {"down-projections' input": e * sbh / own}
    if lat.q_lora:
        terms["compressed query"] = e * sbh * lat.q_lora * (1 / own * lat.norms + 1 / gathered)
    kv_up_input = lat.kv_lora if lat.norms or shape.sp else lat.kv_lora + lat.pos  # a view of the whole output
    terms["compressed key/value"] = e * sbh * ((lat.kv_lora + lat.pos) / own * lat.norms + kv_up_input / gathered)
    terms["q, k, v"] = e * sbh * (2 * lat.heads_qk + (lat.heads_kv if v_view else lat.heads_v)) / t
    return terms


def _moe_fields(cfg: Config) -> dict:
    m = cfg.model
    if not m.moe_enabled:
        return {}
    rows = float(m.moe_router_topk)
    if m.moe_expert_capacity_factor is not None and m.moe_pad_expert_input_to_capacity:
        rows = m.moe_router_topk * m.moe_expert_capacity_factor  # every expert runs its capacity
    return dict(experts=m.num_experts, topk=m.moe_router_topk, expert_ffn=m.expert_ffn_size,
                routed_rows_per_token=rows, shared_ffn=m.moe_shared_expert_intermediate_size or 0, shared_gate=m.moe_shared_expert_gate,
                ep=cfg.parallel.expert_model_parallel_size)  # fmt: skip


def moe_activation_terms(shape: ActivationShape) -> dict[str, float]:
    """What an MoE layer keeps in place of the dense MLP's terms, per micro-batch on one rank.

    Korthikanti's method (every tensor autograd saves, counted once) applied to dtgpt/moe: each
    of the R = k·N routed rows (N = the tokens this rank routes, b·s/cp, /t under SP) is a token
    of an expert MLP, so the MLP terms reappear with R rows and the expert's width f_e:

    moe input (the router's and the shared expert's)  e·s·b·h       as the dense fc1 input
    router: top-k indices (two int64 copies), top-k    (20·k + 4·E)·N
      weights and every expert's score (fp32)
    expert fc1 inputs                                  e·R·h
    expert gelu input | fc1 output (gate and up), silu e·R·f_e | 3·e·R·f_e
    expert fc2 inputs                                  e·R·f_e
    combine: expert outputs, their probability-        2·e·R·h + e·R
      weighted copy (index_add keeps its source), probabilities
    routing indices (int64): the gather, and under     8·R, 3·8·R under ep
      ep the two sorts around the all-to-all
    shared expert (width f_s), as the dense MLP        (1 | 3)·e·s·b·f_s/t + e·s·b·f_s/t
    its gate: the shared output and the score          e·s·b·(h + 1)/t

    tests/test_activation_memory.py measures the saved tensors of a real MoE layer against it.
    """
    e, t = shape.compute_bytes, shape.tp
    n = shape.routed_tokens
    rows = shape.routed_rows_per_token * n
    gated = 3 if shape.swiglu else 1
    terms = {
        "moe input": e * shape.sbh / shape.gathered_divisor,
        "router": (20 * shape.topk + 4 * shape.experts) * n,
        "expert fc1 inputs": e * rows * shape.hidden_size,
        ("expert gate, silu, fc1 outputs" if shape.swiglu else "expert gelu inputs"): gated * e * rows * shape.expert_ffn,
        "expert fc2 inputs": e * rows * shape.expert_ffn,
        "combine: expert outputs, weighted, probabilities": (2 * e * shape.hidden_size + e) * rows,
        "routing indices": (3 if shape.ep > 1 else 1) * 8 * rows,
    }
    if shape.shared_ffn:
        sbf = shape.sbh * shape.shared_ffn / shape.hidden_size
        terms["shared expert"] = (gated + 1) * e * sbf / t
        if shape.shared_gate:  # the product keeps the shared output and the score (sigmoid's output)
            terms["shared expert gate: output, score"] = e * shape.sbh * (1 + 1 / shape.hidden_size) / t
    return terms


def layer_activation_terms(shape: ActivationShape, recompute: str = "none", *, moe: bool = False) -> dict[str, float]:
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
    recompute 'selective': the recompute_modules (recomputed_modules_terms); with core_attn (the
    default) the attention core is recomputed, so no scores and no gathered cp keys and values
    (its inputs q, k, v are kept as before). 'full': only the input of each
    recomputed group, r·s·b·h (/t with SP); the planner counts it once per group.
    With cp, s·b·h is the rank's share (s/cp tokens) while a·s²·b keeps one full s: each local
    query scores every key. Not counted (under 1% at h >= 256): the norms' statistics and a fused
    kernel's log-sum-exp, a few bytes per token. `moe`: an MoE layer, whose MLP terms are
    moe_activation_terms'.
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
    if shape.latent is not None:
        del terms["qkv input"], terms["q, k, v"]
        terms.update(latent_attention_terms(shape, recompute))
    if moe:
        for dense in ("fc1 input", "gate, silu, fc1 outputs", "gelu input", "fc2 input"):
            terms.pop(dense, None)
        terms.update(moe_activation_terms(shape))
    if shape.qk_norm_width:
        terms["qk-norm inputs"] = shape.qk_norm_width * e * sbh / t
    if shape.hidden_dropout:
        terms["hidden dropout masks"] = 2 * sbh / shape.sp_divisor
    scores = sbh * shape.num_heads * shape.seq_length / shape.hidden_size / t  # a·(s/cp)·s·b / t elements
    if shape.scores_kept and not core_recomputed(shape, recompute):
        terms["softmax output"] = e * scores
        if shape.attention_dropout:
            terms["attention dropout mask, output"] = (1 + e) * scores
    if not core_recomputed(shape, recompute) and shape.cp > 1:  # every head's keys and values (MLA: its q/k and v widths)
        kv_width = 2 if shape.latent is None else shape.latent.heads_qk + shape.latent.heads_v
        terms["cp keys and values"] = kv_width * e * sbh * (shape.cp - 1) / t
    return recomputed_modules_terms(shape, terms, moe) if recompute == "selective" else terms


def core_recomputed(shape: ActivationShape, recompute: str) -> bool:
    return recompute == "selective" and "core_attn" in shape.recompute_modules


def recomputed_modules_terms(shape: ActivationShape, terms: dict[str, float], moe: bool) -> dict[str, float]:
    """A selectively recomputed layer's terms (dtgpt/parallel/recompute_modules.py), from the terms
    of `recompute_modules` minus core_attn (done by the caller):

    mlp             a dense layer's MLP keeps its input only, fc1's input (dtgpt's SP plan gathers
                    it before the MLP), not what follows
    moe             an MoE layer keeps its input only ("moe input")
    shared_experts  the shared expert's term goes (its input is the moe input)
    moe_act         the experts keep fc1's output (SwiGLU: gate and up, 2·e·R·f_e), not the
                    activation's intermediate or output (fc2's input)
    layernorm       the norms' outputs go: the qkv input (MLA: the down-projections'), the fc1
                    input (or an MLP's kept input; an MoE layer's only when the layer is
                    recomputed, the router reading a token-major copy); none under SP (dtgpt keeps
                    the gathered input, and a norm's output there is not released)
    mla_up_proj     q, k and v go where the core keeps them (a fused kernel, or the recomputed
                    core); the math kernel keeps copies of them (scaled q and k, v made
                    contiguous), which stay
    """
    mods, e = shape.recompute_modules, shape.compute_bytes
    if "mlp" in mods and not moe:
        for dense in ("gate, silu, fc1 outputs", "gelu input", "fc2 input"):
            terms.pop(dense, None)
    if moe and "moe" in mods:
        terms = {k: v for k, v in terms.items() if k == "moe input" or k not in moe_activation_terms(shape)}
    if moe and "shared_experts" in mods:
        terms.pop("shared expert", None)
    if moe and "moe_act" in mods and "moe" not in mods:
        rows = shape.routed_rows_per_token * shape.routed_tokens
        terms.pop("expert gate, silu, fc1 outputs" if shape.swiglu else "expert gelu inputs")
        terms["expert fc1 outputs"] = (2 if shape.swiglu else 1) * e * rows * shape.expert_ffn
        terms.pop("expert fc2 inputs")
    if "layernorm" in mods and not shape.sp:
        for normed in ("qkv input", "down-projections' input", "fc1 input" if not moe else "moe input" if "moe" in mods else ""):
            terms.pop(normed, None)
    if "mla_up_proj" in mods and shape.latent is not None:
        if not shape.scores_kept or "core_attn" in mods:
            terms.pop("q, k, v")
    return terms


def layer_activation_bytes(shape: ActivationShape, recompute: str, *, moe: bool = False) -> float:
    """The sum of layer_activation_terms."""
    return sum(layer_activation_terms(shape, recompute, moe=moe).values())


def embedding_activation_bytes(shape: ActivationShape) -> float:
    """First stage: the 1-byte dropout mask of the embedding output (s·b·h, /t under Megatron's SP;
    dtgpt drops before the sequence split); none at p = 0."""
    if not shape.hidden_dropout:
        return 0.0
    return shape.sbh / shape.gathered_divisor


def head_activation_terms(shape: ActivationShape) -> dict[str, float]:
    """Last stage: final-norm input (r·s·b·h, /t under SP), the head input (e·s·b·h, as a
    column-parallel input) and the vocabulary-sharded logits: compute dtype + an fp32 copy for
    the loss + its gradient."""
    e, s, b, v, t = shape.compute_bytes, shape.local_tokens, shape.micro_batch_size, shape.padded_vocab, shape.tp
    return {
        "final norm input": (shape.residual_bytes or e) * shape.sbh / shape.sp_divisor,
        "head input": e * shape.sbh / shape.gathered_divisor,
        "logits": (e + 4 + 4) * s * b * v / t,
    }


def head_activation_bytes(shape: ActivationShape) -> float:
    """The sum of head_activation_terms."""
    return sum(head_activation_terms(shape).values())
