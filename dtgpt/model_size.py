"""Closed forms for the size of a GPT: its parameters and its training FLOPs per token.

A mixture-of-experts block (model.num_experts, every moe_layer_freq-th block from block 0)
holds a router (E x h, and E biases with add_bias_linear), E experts of the MLP's shape at
width moe_ffn_hidden_size (default ffn_hidden_size), and an optional shared expert (an MLP of
width moe_shared_expert_intermediate_size) in place of the dense MLP. A token runs through the
router, its top-k experts and the shared expert: its *active* parameters count k experts.
"""

from __future__ import annotations

from dtgpt.config import ModelConfig


def _norm(cfg: ModelConfig, size: int) -> int:
    return 2 * size if cfg.normalization == "LayerNorm" else size


def _mlp(cfg: ModelConfig, width: int) -> int:
    """An MLP of `width` (fc1, SwiGLU's second input, fc2, their biases)."""
    h, bias = cfg.hidden_size, cfg.add_bias_linear
    return (2 if cfg.swiglu else 1) * (h * width + (width if bias else 0)) + width * h + (h if bias else 0)


def _latent_attention(cfg: ModelConfig) -> int:
    """Multi-latent attention (dtgpt/mla.py): down- and up-projections, their norms, output."""
    h, nh, r = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_pos_emb_head_dim
    q_width, norms = nh * (cfg.qk_head_dim + r), cfg.qk_layernorm
    if cfg.q_lora_rank is None:
        q = h * q_width
    else:
        q = cfg.q_lora_rank * (h + q_width) + (_norm(cfg, cfg.q_lora_rank) if norms else 0)
    kv = h * (cfg.kv_lora_rank + r) + cfg.kv_lora_rank * nh * (cfg.qk_head_dim + cfg.v_head_dim)
    kv += _norm(cfg, cfg.kv_lora_rank) if norms else 0
    return q + kv + nh * cfg.v_head_dim * h + (h if cfg.add_bias_linear else 0)


def _attention(cfg: ModelConfig) -> int:
    if cfg.multi_latent_attention:
        return _latent_attention(cfg)
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.query_groups * hd  # query and key (or value) widths
    qkv = h * (q + 2 * kv) + ((q + 2 * kv) if cfg.qkv_bias else 0)
    proj = q * h + (h if cfg.add_bias_linear else 0)
    sinks = cfg.num_attention_heads if cfg.softmax_type == "learnable" else 0  # one learned logit per head
    return qkv + proj + (2 * _norm(cfg, hd) if cfg.qk_layernorm else 0) + sinks


def num_moe_layers(cfg: ModelConfig) -> int:
    """Blocks whose MLP is a mixture of experts (block i when i % moe_layer_freq == 0)."""
    return sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))


def moe_parameters(cfg: ModelConfig, experts: int | None = None) -> int:
    """One MoE layer's parameters with `experts` experts (default all of them; the top-k for the
    active count): router, experts, shared expert."""
    experts = cfg.num_experts if experts is None else experts
    router = cfg.num_experts * cfg.hidden_size + (cfg.num_experts if cfg.add_bias_linear else 0)
    shared = _mlp(cfg, cfg.moe_shared_expert_intermediate_size) if cfg.moe_shared_expert_intermediate_size else 0
    shared += cfg.hidden_size if shared and cfg.moe_shared_expert_gate else 0  # the gate's one row
    return router + experts * _mlp(cfg, cfg.expert_ffn_size) + shared


def num_parameters(cfg: ModelConfig, vocab_size: int, *, active: bool = False) -> int:
    """Closed-form parameter count of the full model (tied head counted once; multi-token
    prediction apart: mtp_parameters); `active`: the parameters one token uses (k of each MoE
    layer's experts), Mixtral's "12.9B of 46.7B"."""
    h, L = cfg.hidden_size, cfg.num_layers
    moe = num_moe_layers(cfg)
    block = 2 * _norm(cfg, h) + _attention(cfg)
    experts = cfg.moe_router_topk if active else None
    mlps = (L - moe) * _mlp(cfg, cfg.ffn_size) + (moe * moe_parameters(cfg, experts) if moe else 0)
    embed = vocab_size * h + (cfg.max_positions * h if cfg.position_embedding_type == "learned_absolute" else 0)
    head = 0 if not cfg.untie_embeddings_and_output_weights else vocab_size * h
    return L * block + mlps + embed + _norm(cfg, h) + head


def mtp_parameters(cfg: ModelConfig, *, active: bool = False) -> int:
    """The multi-token prediction modules' own parameters (dtgpt/mtp.py), counted apart from the
    model's as DeepSeek counts them: per module its three norms, eh_proj (2h x h) and a block of
    the last block's kind; the embedding and the head are the model's."""
    h = cfg.hidden_size
    last_moe = cfg.is_moe_layer(cfg.num_layers - 1)
    mlp = moe_parameters(cfg, cfg.moe_router_topk if active else None) if last_moe else _mlp(cfg, cfg.ffn_size)
    return cfg.mtp_depth * (3 * _norm(cfg, h) + 2 * h * h + 2 * _norm(cfg, h) + _attention(cfg) + mlp)


def flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    """Training FLOPs per token: Megatron-LM's `num_floating_point_operations` divided by tokens.

    That is Narayanan et al. (2021)'s 72·L·h²·(1 + s/(6h) + V/(12·L·h)) generalised to any MLP
    width, grouped-query attention and SwiGLU: forward + backward (3x) of the QKV, output and MLP
    matmuls (2 FLOPs per multiply-add), the s×s attention scores and values counted in full (no
    causal discount), and the logit layer. Recomputation is not counted (it is extra work, not
    useful FLOPs). An MoE layer counts its top-k experts and the shared expert, as Megatron's
    formula does; the router's small matmul is left out there too (router_flops_per_token: under
    0.1% of Mixtral's), so that logged TFLOP/s compare with Megatron's. Multi-token prediction adds
    mtp_flops_per_token.
    """
    moe = num_moe_layers(cfg)
    dense = cfg.num_layers - moe
    total = dense * layer_flops_per_token(cfg) + moe * (layer_flops_per_token(cfg, moe=True) if moe else 0)
    return total + mtp_flops_per_token(cfg, vocab_size) + 6 * cfg.hidden_size * vocab_size


def mtp_flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    """Multi-token prediction's forward + backward FLOPs per token, Megatron-LM's terms: per module
    a block of the last block's kind, its norms (3h, as Megatron counts them) and eh_proj (2h x h),
    and one more pass through the output head."""
    h, depth = cfg.hidden_size, cfg.mtp_depth
    block = layer_flops_per_token(cfg, moe=cfg.is_moe_layer(cfg.num_layers - 1))
    return depth * (block + 6 * (3 * h + 2 * h * h) + 6 * h * vocab_size)


def layer_flops_per_token(cfg: ModelConfig, *, moe: bool = False) -> float:
    """Forward + backward FLOPs of one block per token (the per-layer term of flops_per_token);
    `moe`: of an MoE block (k experts and the shared expert) instead of a dense one."""
    h, s = cfg.hidden_size, cfg.seq_length
    query_width = cfg.num_attention_heads * cfg.head_dim / h
    attention = (1 + cfg.query_groups / cfg.num_attention_heads + s / h) * query_width
    if cfg.multi_latent_attention:
        attention = latent_attention_flops_per_token(cfg) / (12 * h * h)
    gated = 1.5 if cfg.swiglu else 1.0
    if not moe:
        return 12 * h * h * (attention + cfg.ffn_size / h * gated)
    widths = cfg.moe_router_topk * cfg.expert_ffn_size + (cfg.moe_shared_expert_intermediate_size or 0)
    return 12 * h * h * (attention + widths / h * gated)


def latent_attention_flops_per_token(cfg: ModelConfig) -> float:
    """Multi-latent attention's forward + backward FLOPs per token, Megatron-LM's term: 6 x (the
    projections' multiply-adds, one per norm channel, and the scores and values over s/2 keys:
    its MLA term discounts the causal half)."""
    h, nh, s = cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length
    qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    q = h * nh * qk if cfg.q_lora_rank is None else cfg.q_lora_rank * (h + nh * qk + 1)
    kv = cfg.kv_lora_rank * (h + nh * (cfg.qk_head_dim + cfg.v_head_dim) + 1) + h * cfg.qk_pos_emb_head_dim
    core = s * nh * qk / 2 + s * nh * cfg.v_head_dim / 2
    return 6 * (q + kv + nh * cfg.v_head_dim * h + core)


def router_flops_per_token(cfg: ModelConfig) -> float:
    """The routers' forward + backward FLOPs per token, 6·h·E per MoE layer: real work that
    flops_per_token leaves out as Megatron does (the planner adds it to the hardware FLOPs)."""
    return num_moe_layers(cfg) * 6 * cfg.hidden_size * (cfg.num_experts or 0)
