"""Megatron-LM's GPT family in plain single-device PyTorch.

GPT-3 by default: pre-LayerNorm blocks, learned absolute position embeddings, causal attention
through `scaled_dot_product_attention`, a GeLU MLP, biases everywhere, and an output head tied
to the word embedding. Llama-style options with Megatron's names (dtgpt/config/sections.py):
grouped-query attention, SwiGLU, RMSNorm, RoPE, no biases, qk-layernorm, an untied head. This file never imports torch.distributed: parallelism is
applied from the outside (dtgpt/parallel). What the model concedes to pipelining: blocks live in
an `nn.ModuleDict` keyed "0".."L-1" (names survive deleting blocks), and the embedding, final
norm and head may be None on a pipeline stage. What it concedes to recomputation: the attention
core is a module of its own, and `block_runs` may group blocks (see dtgpt/parallel/recompute.py).

Each module declares the initialisation of its own parameters (`declared_inits`); `init_weights`
draws every value from a generator seeded by (seed, parameter name) on the full shape, each rank
only its own region of it (dtgpt.inits.fill_draw).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, ContextManager

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtgpt import varlen_kernel
from dtgpt.attention_sink import AttentionSink, attend_with_sink
from dtgpt.attention_varlen import Documents, WholeRows, documents_attention
from dtgpt.config import ModelConfig
from dtgpt.discard import normed_sublayer
from dtgpt.inits import DeclaredInits, Draw, Init, fill_draw, initial_draw, linear_inits
from dtgpt.mla import MLASelfAttention
from dtgpt.mlp import MLP
from dtgpt.moe.layer import MoELayer
from dtgpt.mtp import MultiTokenPrediction
from dtgpt.norms import build_norm, l2_norm, norm_inits
from dtgpt.rope import apply_rotary, rotary_frequencies

WORD_EMBEDDING = "embedding.word.weight"
OUTPUT_WEIGHT = "output.weight"


RandomStream = Callable[[], ContextManager]
"""A context under which a dropout draws its mask. The default draws from torch's default
generator; dtgpt.parallel.rng installs its model-parallel stream where a tp rank holds only a
slice of the activations (local heads, a sequence-parallel chunk)."""


class Dropout(nn.Module):
    """nn.Dropout whose mask is drawn under `self.stream` (see RandomStream).

    `token_index` is unused here: dtgpt.parallel.invariant_dropout swaps in a dropout that keys
    its mask on it (model.dropout_rng='layout_invariant').
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.stream: RandomStream = contextlib.nullcontext

    def forward(self, x: torch.Tensor, token_index: torch.Tensor | None = None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.stream():
            # native_dropout keeps a 1-byte bool mask for backward, as Megatron's count assumes
            # (dtgpt.plan.activations); F.dropout does that on CUDA only, and on CPU keeps the
            # scaled mask in x's dtype. The same generator state draws the same mask.
            return torch.native_dropout(x, self.p, True)[0]


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
        # Always on the full sequence (before a sequence-parallel split): a replicated region.
        self.dropout = Dropout(cfg.hidden_dropout)
        # Megatron's fp32_residual_connection (set by dtgpt.parallel under fp16/bf16).
        self.fp32_residual = False

    def declared_inits(self) -> DeclaredInits:
        inits = [(self.word.weight, Init.EMBEDDING)]
        if self.position is not None:
            inits.append((self.position.weight, Init.EMBEDDING))
        return inits

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, token_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """position_ids (B, T): each token's position (None: 0..T-1); token_index: see GPT.forward."""
        h = self.word(tokens)  # (B, T, C)
        if self.position is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.position(position_ids)
        if self.fp32_residual:
            h = h.float()  # the residual stream stays fp32 from here (fp16/bf16 runs)
        return self.dropout(h, token_index)


def allowed_keys(
    q_idx: torch.Tensor, k_idx: torch.Tensor, q_docs: torch.Tensor | None = None, k_docs: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The attention mask as a predicate on global token indices: key j is visible to query i
    when j <= i (and i - j <= window under a sliding window; and both are in the same document
    when document ids are given).

    q_idx (Tq,), k_idx (Tk,) -> (Tq, Tk); with q_docs (B, Tq), k_docs (B, Tk) -> (B, 1, Tq, Tk).
    """
    mask = k_idx[None, :] <= q_idx[:, None]
    if window is not None:
        mask = mask & (k_idx[None, :] >= q_idx[:, None] - window)
    if q_docs is not None:
        mask = (mask & (q_docs[:, :, None] == k_docs[:, None, :])).unsqueeze(1)  # broadcast over heads
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """SDPA of q (B, nh, Tq, hd) over k, v (B, ng, Tk, hd), query head i reading key/value head
    i // (nh / ng) (grouped-query attention); mask None means causal."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, enable_gqa=k.shape[1] != q.shape[1]
    )


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(hd)) v with causal masking and attention dropout, a sliding window and
    a sink (softmax_offset: dtgpt/attention_sink.py) where [model] asks. Megatron's "core attention":
    what selective recomputation recomputes, its (B, nh, T, T) scores a block's largest activations."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        """index: the block's place in the whole model (from 0), which picks its window."""
        super().__init__()
        self.attention_dropout = cfg.attention_dropout
        self.stream: RandomStream = contextlib.nullcontext  # under tp: this rank's heads only
        self.window = cfg.attention_window(index)  # how far back a query sees; None: its whole past
        self.whole_rows = WholeRows()  # the varlen kernel's bounds for a window without documents

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,  # unused: as Dropout
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (B, nh, T, hd); k, v (B, ng, T, hd) with ng dividing nh (see attend); document_ids
        (B, T), or Documents where the batch counted their bounds (dtgpt/attention_varlen.py);
        sink (nh,): each head's sink logit (dtgpt/attention_sink.py), None: none."""
        dropout = self.attention_dropout if self.training else 0.0
        # On CUDA, flash attention's varlen kernel without a mask (it has no dropout, no sink).
        documents = isinstance(document_ids, Documents)
        varlen = documents or (document_ids is None and self.window is not None)  # else no kernel is looked up
        kernel = varlen_kernel.windowed_kernel_for(q, self.window) if varlen and not dropout and sink is None else None
        if kernel is not None:
            bounds = document_ids.bounds if documents else self.whole_rows(q.shape[0], q.shape[2], q.device)
            return documents_attention(kernel, q, k, v, bounds, self.window)  # (B, nh, T, hd)
        # Elsewhere: SDPA with an explicit boolean mask (docs/data.md says why not flex attention).
        document_ids = document_ids.ids if documents else document_ids
        mask = None
        if document_ids is not None or self.window is not None or sink is not None:
            idx = torch.arange(q.shape[2], device=q.device)
            mask = allowed_keys(idx, idx, document_ids, document_ids, self.window)
        with self.stream() if dropout else contextlib.nullcontext():
            if sink is not None:
                return attend_with_sink(q, k, v, mask, sink, dropout)  # (B, nh, T, hd)
            return attend(q, k, v, mask=mask, dropout=dropout)  # (B, nh, T, hd)


class Attention(nn.Module):
    """Causal self-attention, grouped-query (ng key/value heads shared by nh query heads), with a
    fused QKV projection.

    The QKV weight rows are laid out group by group, [group, (q_1 .. q_{nh/ng} | k | v), head_dim]
    (Megatron's layout; one group per head without grouped-query attention), so that cutting the
    rows into tp equal pieces gives each rank whole groups: column parallelism needs no reordering.
    With fewer groups than tp ranks, each rank gets the whole QKV output (dtgpt.parallel.tensor
    gathers it, as Megatron does) and takes its group and its share of the group's query heads
    (`shared_group`).
    """

    def __init__(self, cfg: ModelConfig, index: int = 0):
        """index: the block's place in the whole model (from 0), which picks its window and RoPE."""
        super().__init__()
        hd, nh, ng = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
        self.head_dim, self.queries_per_group = hd, nh // ng
        self.qkv = nn.Linear(cfg.hidden_size, (nh + 2 * ng) * hd, bias=cfg.qkv_bias)
        self.q_norm = build_norm(cfg, hd) if cfg.qk_layernorm else None
        self.k_norm = build_norm(cfg, hd) if cfg.qk_layernorm else None
        self.core = CoreAttention(cfg, index)
        self.sink = AttentionSink(nh) if cfg.softmax_type == "learnable" else None  # Megatron's core_attention.softmax_offset
        self.off_by_one = cfg.softmax_type == "off-by-one"
        self.proj = nn.Linear(nh * hd, cfg.hidden_size, bias=cfg.add_bias_linear)
        self.cfg = cfg  # RoPE's frequencies are drawn from it on the activations' device
        self.rope = cfg.position_embedding_type == "rope" and not cfg.skips_rope(index)
        self.l2_eps = cfg.norm_epsilon if cfg.qk_l2_norm else None  # Llama 4's weightless qk norm
        # (ranks sharing a group, this rank's index among all of them): set by dtgpt.parallel.tensor
        # when there are fewer key/value groups than tp ranks; None: this rank holds whole groups.
        self.shared_group: tuple[int, int] | None = None

    def declared_inits(self) -> DeclaredInits:
        inits = linear_inits(self.qkv, Init.NORMAL) + linear_inits(self.proj, Init.SCALED_NORMAL)
        for norm in (self.q_norm, self.k_norm):
            inits += norm_inits(norm) if norm is not None else []
        return inits

    def forward(self, x: torch.Tensor, position_ids=None, document_ids=None, token_index=None) -> torch.Tensor:
        """x (B, T, C); the per-token inputs as GPT.forward takes them."""
        B, T, _ = x.shape
        # -1 groups: under tensor parallelism this rank holds only its share of the groups.
        qkv = self.qkv(x).view(B, T, -1, self.queries_per_group + 2, self.head_dim)  # (B, T, ng, nh/ng + 2, hd)
        if self.shared_group is not None:  # every group is here: take this rank's group and queries
            sharing, rank = self.shared_group
            queries = self.queries_per_group // sharing
            group = qkv[:, :, rank // sharing : rank // sharing + 1]  # (B, T, 1, nh/ng + 2, hd)
            first = rank % sharing * queries
            qkv = torch.cat((group[:, :, :, first : first + queries], group[:, :, :, -2:]), dim=3)
        q, k, v = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]  # (B, T, nh or ng, hd)
        if self.q_norm is not None or self.rope or self.l2_eps is not None:
            # The norms and RoPE make new tensors of q and k; a view that backward keeps (a
            # norm's input, attention's v) would keep the whole QKV output alive: copies keep just it.
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.l2_eps is not None:
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.rope:
            inv_freq = rotary_frequencies(self.cfg, x.device)
            q = apply_rotary(q, inv_freq, position_ids, self.cfg.rotary_interleaved)
            k = apply_rotary(k, inv_freq, position_ids, self.cfg.rotary_interleaved)
        # Head-major views of token-major tensors: attention's output keeps the token-major
        # layout, so the projection's input below is a view of it, not a copy.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh or ng, T, hd)
        sink = self.sink() if self.sink is not None else q.new_zeros(q.shape[1]) if self.off_by_one else None  # (nh,)
        y = self.core(q, k, v, document_ids=document_ids, token_index=token_index, sink=sink)  # (B, nh, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))  # from (B, T, nh * hd)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        """index: the block's place in the whole model (from 0), which picks MLP or MoE."""
        super().__init__()
        self.input_norm = build_norm(cfg)
        self.attention = MLASelfAttention(cfg, CoreAttention(cfg, index)) if cfg.multi_latent_attention else Attention(cfg, index)
        self.mlp_norm = build_norm(cfg)
        self.mlp: nn.Module = MLP(cfg)
        if cfg.is_moe_layer(index):
            shared = cfg.moe_shared_expert_intermediate_size
            self.mlp = MoELayer(cfg, MLP(dataclasses.replace(cfg, ffn_hidden_size=shared)) if shared else None)
        # Megatron's hidden dropout after each sub-layer (on a sequence-parallel chunk under sp);
        # two modules, so that a mask keyed on what it drops (layout-invariant) differs between them.
        self.dropout = Dropout(cfg.hidden_dropout)
        self.mlp_dropout = Dropout(cfg.hidden_dropout)

    def declared_inits(self) -> DeclaredInits:
        return norm_inits(self.input_norm) + norm_inits(self.mlp_norm)

    def forward(self, x: torch.Tensor, position_ids=None, document_ids=None, token_index=None) -> torch.Tensor:
        """x (B, T, C); the per-token inputs as GPT.forward takes them."""
        per_token = dict(position_ids=position_ids, document_ids=document_ids, token_index=token_index)
        attention, discard = lambda n: self.attention(n, **per_token), getattr(self, "discard_norm_outputs", False)  # 'layernorm' recomputation
        x = x + self.dropout(normed_sublayer(self.input_norm, attention, x, discard), token_index)
        return x + self.mlp_dropout(normed_sublayer(self.mlp_norm, self.mlp, x, discard), token_index)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        """vocab_size is the padded vocabulary (see padded_vocab_size)."""
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embedding: Embedding | None = Embedding(cfg, vocab_size)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = build_norm(cfg)
        self.output: nn.Linear | None = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        # Multi-token prediction (dtgpt/mtp.py): blocks of the last block's kind, as Megatron's.
        self.mtp: MultiTokenPrediction | None = None
        if cfg.mtp_depth:
            self.mtp = MultiTokenPrediction(cfg, [Block(cfg, cfg.num_layers - 1) for _ in range(cfg.mtp_depth)])
        # False on a later pipeline stage that holds the embedding for multi-token prediction only.
        self.embeds_input = True
        self.tied = not cfg.untie_embeddings_and_output_weights
        if self.tied:
            self.output.weight = self.embedding.word.weight
        # What forward runs between the embedding and the final norm; None: the blocks one by one.
        # Full recomputation (dtgpt.parallel.recompute) replaces runs of blocks by groups that
        # backward recomputes as one unit, as Megatron's recompute_method does.
        self.block_runs: list[Callable[..., torch.Tensor]] | None = None

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Token ids (B, T) -> logits (B, T, V); a pipeline stage maps whatever it holds. In
        training with multi-token prediction, (logits, the logits of each prediction depth).

        position_ids (B, T): the positions the position embedding or RoPE use (None: 0..T-1);
        under context parallelism, the global positions of the chunks this rank holds.
        document_ids (B, T): tokens attend only within their document (None: plain causal).
        token_index (B, T): each token's index in the whole run, sample number * seq_length +
        position; only a layout-invariant dropout reads it (dtgpt.parallel.invariant_dropout).
        input_ids (B, T): the token ids, for multi-token prediction on a stage whose input `x` is
        the hidden state (a later pipeline stage).
        """
        if self.embeds_input:
            input_ids = x
            if self.embedding is not None:
                x = self.embedding(x, position_ids, token_index)
        h = x
        for run in self.block_runs if self.block_runs is not None else self.layers.values():
            h = run(h, position_ids=position_ids, document_ids=document_ids, token_index=token_index)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        if self.mtp is None or not self.training:  # evaluation reports the LM loss alone, as Megatron's
            return logits
        per_token = dict(position_ids=position_ids, document_ids=document_ids, token_index=token_index)
        return (logits, *self.mtp(h, input_ids, self.embedding, self.output, **per_token))

    # -- initialisation ------------------------------------------------------------------------

    def declared_inits(self) -> DeclaredInits:
        inits = norm_inits(self.norm) if self.norm is not None else []
        if self.output is not None:  # tied, it is the word embedding (or, on a last stage, its copy)
            inits.append((self.output.weight, Init.EMBEDDING if self.tied else Init.NORMAL))
        return inits

    def init_kinds(self) -> dict[str, Init]:
        """Parameter name -> the init its module declares; every parameter must have one."""
        declared: dict[int, Init] = {}  # by identity: a tied weight is one parameter, declared twice
        for module in self.modules():
            if not hasattr(module, "declared_inits"):
                continue  # stock layers (nn.Linear, ...): their owner declares for them
            for param, kind in module.declared_inits():
                if declared.setdefault(id(param), kind) != kind:
                    raise ValueError(
                        f"{type(module).__name__} declares {kind} for a parameter already declared {declared[id(param)]}"
                    )
        kinds = {}
        for name, param in self.named_parameters():
            if id(param) not in declared:
                raise ValueError(f"parameter {name} has no declared init: add it to its module's declared_inits()")
            kinds[name] = declared[id(param)]
        return kinds

    def initial_draw(self, name: str, kind: Init, shape: torch.Size) -> tuple[str, Draw]:
        """(the name whose generator draws parameter `name`, its random init: dtgpt.inits.initial_draw)."""
        if name == OUTPUT_WEIGHT and self.tied:
            name = WORD_EMBEDDING  # the last pipeline stage's copy of the tied weight starts equal
        fan_out, fan_in = shape[0], shape[-1]
        if self.cfg.swiglu and name.endswith((".mlp.fc1.weight", ".mlp.gate.weight")):
            fan_out *= 2  # Megatron's fc1 holds [gate; fc1] in one matrix: its xavier fan is theirs together
        return name, initial_draw(self.cfg, kind, (fan_in, fan_out))

    @torch.no_grad()
    def init_weights(
        self,
        seed: int,
        local: Callable[[torch.Tensor], tuple[torch.Tensor, tuple[int, ...]]] | None = None,
    ) -> None:
        """Give *every* parameter its initial value (call after `to_empty`).

        Each parameter's full initial tensor is a function of (name, kind, shape, seed) only: it
        draws from its own generator seeded by its name, so the value does not depend on which
        other parameters a rank holds or in which order they are visited. `local(param)` gives
        the tensor a rank holds of a (maybe sharded) parameter and its offsets in the full one
        (default: the whole); only that region is drawn (dtgpt.inits.fill_draw), so no rank
        creates a whole parameter.
        """
        for module in self.modules():
            if hasattr(module, "init_buffers"):  # state that is not a parameter (the router's expert bias)
                module.init_buffers()
        kinds = self.init_kinds()
        for name, param in self.named_parameters():
            held, offsets = local(param) if local is not None else (param, (0,) * param.dim())
            kind = kinds[name]
            if kind is Init.ZEROS:
                held.zero_()
            elif kind is Init.ONES:
                held.fill_(1.0)
            else:
                drawn, draw = self.initial_draw(name, kind, param.shape)
                fill_draw(held, drawn, param.shape, offsets, draw, seed)
