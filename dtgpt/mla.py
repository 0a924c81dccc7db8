"""Multi-latent attention (DeepSeek-V2/V3) with Megatron-Core's semantics and parameter names,
in plain single-device PyTorch (the training path: no KV cache).

    q  = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))     (or linear_q_proj(x) without q_lora_rank)
    c, k_pe = split(linear_kv_down_proj(x))                        (kv_lora_rank | qk_pos_emb_head_dim)
    k_nope, v = split(linear_kv_up_proj(kv_layernorm(c)))          per head: (qk_head_dim | v_head_dim)
    q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe)]             k_pe: one RoPE part shared by every head

Megatron's choices kept: the norms on the compressed query and key/value exist with
model.qk_layernorm (its layer specs put them there only then); RoPE first de-interleaves the
rotated channels (even ones, then odd) and rotates pairs (i, i + d/2); YaRN multiplies cos and
sin by its attention factor; the softmax scale is mscale(factor, mscale_all_dim)^2 /
sqrt(qk_head_dim + qk_pos_emb_head_dim). Only the output projection may have a bias.

What it concedes to tensor parallelism (dtgpt/parallel/tensor_mla.py): the up-projections'
outputs are viewed with -1 heads (a rank holds its own), and the shared RoPE key goes through
`k_pos_emb`, an identity here, where the plan gathers it whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dtgpt.config import ModelConfig
from dtgpt.discard import run_without_saving
from dtgpt.inits import DeclaredInits, Init, linear_inits
from dtgpt.norms import build_norm, norm_inits
from dtgpt.rope import apply_rotary, latent_rotary_frequencies, yarn_mscale


class SharedKey(nn.Module):
    """The identity: the point where tensor parallelism gathers the RoPE key every head reads."""

    def forward(self, k_pe: torch.Tensor) -> torch.Tensor:
        return k_pe


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Channels (0, 2, 4, ..., 1, 3, 5, ...): Megatron's order before it rotates MLA's RoPE part."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLASelfAttention(nn.Module):
    """Causal multi-latent self-attention; `core` is the attention core (dtgpt.model.CoreAttention),
    passed in so that context parallelism, recomputation and dropout treat it as any other core."""

    def __init__(self, cfg: ModelConfig, core: nn.Module):
        super().__init__()
        nh, h = cfg.num_attention_heads, cfg.hidden_size
        self.cfg = cfg
        self.q_head_dim = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        if cfg.q_lora_rank is None:
            self.linear_q_proj = nn.Linear(h, nh * self.q_head_dim, bias=False)
        else:
            self.linear_q_down_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_layernorm = build_norm(cfg, cfg.q_lora_rank) if cfg.qk_layernorm else None
            self.linear_q_up_proj = nn.Linear(cfg.q_lora_rank, nh * self.q_head_dim, bias=False)
        self.linear_kv_down_proj = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, bias=False)
        self.kv_layernorm = build_norm(cfg, cfg.kv_lora_rank) if cfg.qk_layernorm else None
        self.linear_kv_up_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_head_dim + cfg.v_head_dim), bias=False)
        self.k_pos_emb = SharedKey()
        self.core = core
        self.linear_proj = nn.Linear(nh * cfg.v_head_dim, h, bias=cfg.add_bias_linear)
        # SDPA divides by sqrt(q_head_dim); YaRN's softmax scale is that times mscale^2, applied to q.
        self.query_scale = yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2
        self.recompute_up_proj = False
        """Megatron's 'mla_up_proj' recomputation (dtgpt.parallel.recompute_modules)."""

    def declared_inits(self) -> DeclaredInits:
        inits = linear_inits(self.linear_kv_down_proj, Init.NORMAL) + linear_inits(self.linear_kv_up_proj, Init.NORMAL)
        inits += linear_inits(self.linear_proj, Init.SCALED_NORMAL)
        if self.cfg.q_lora_rank is None:
            inits += linear_inits(self.linear_q_proj, Init.NORMAL)
        else:
            inits += linear_inits(self.linear_q_down_proj, Init.NORMAL) + linear_inits(self.linear_q_up_proj, Init.NORMAL)
        for norm in (getattr(self, "q_layernorm", None), self.kv_layernorm):
            inits += norm_inits(norm) if norm is not None else []
        return inits

    def forward(self, x: torch.Tensor, position_ids=None, document_ids=None, token_index=None) -> torch.Tensor:
        """x (B, T, C); the per-token inputs as GPT.forward takes them."""
        cfg = self.cfg
        q_in = x if cfg.q_lora_rank is None else self.linear_q_down_proj(x)
        if getattr(self, "q_layernorm", None) is not None:
            q_in = self.q_layernorm(q_in)
        compressed, k_pe = self.linear_kv_down_proj(x).split([cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        if self.kv_layernorm is not None:
            compressed = self.kv_layernorm(compressed)
        k_pe = self.k_pos_emb(k_pe)
        up = (q_in, compressed, k_pe, position_ids)
        if self.recompute_up_proj:  # Megatron's 'mla_up_proj': keep the inputs, not q, k, v
            (q, k, v), discard = run_without_saving(self.up_projections, *up)
        else:
            q, k, v = self.up_projections(*up)
        y = self.core(q, k, v, document_ids=document_ids, token_index=token_index)  # (B, nh, T, v)
        if self.recompute_up_proj:
            discard(y)
        B, T = y.shape[0], y.shape[2]
        return self.linear_proj(y.transpose(1, 2).reshape(B, T, -1))  # from (B, T, nh * v)

    def up_projections(self, q_in: torch.Tensor, compressed: torch.Tensor, k_pe: torch.Tensor, position_ids=None):
        """The heads' q, k (RoPE'd) and v, each (B, nh, T, d), from the compressed query (or x
        without q_lora_rank), the normed compressed key/value and the shared RoPE key (B, T, pe);
        heads: this rank's under tensor parallelism."""
        cfg = self.cfg
        q = self.linear_q_proj(q_in) if cfg.q_lora_rank is None else self.linear_q_up_proj(q_in)
        kv = self.linear_kv_up_proj(compressed)
        B, T = q.shape[:2]  # q and kv are plain tensors here, whatever x was
        q = q.view(B, T, -1, self.q_head_dim)  # (B, T, nh, qk + pe)
        kv = kv.view(B, T, -1, cfg.qk_head_dim + cfg.v_head_dim)  # (B, T, nh, qk + v)
        q_nope, q_pe = q.split([cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        k_nope, v = kv.split([cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2)  # (B, T, 1, pe): one for every head
        inv_freq, factor = latent_rotary_frequencies(cfg, q.device)
        q_pe = apply_rotary(deinterleave(q_pe), inv_freq, position_ids, attention_factor=factor)
        k_pe = apply_rotary(deinterleave(k_pe), inv_freq, position_ids, attention_factor=factor)
        q = torch.cat((q_nope, q_pe), dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat((k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, d)
