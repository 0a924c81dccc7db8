"""Rotary position embeddings (RoPE) as Megatron-LM computes them: its frequencies (Llama 3.1's
scaling included; YaRN's for multi-latent attention), its two channel-pair conventions, and a
rotated fraction of each head."""

from __future__ import annotations

import math

import torch

from dtgpt.config import ModelConfig


def rotary_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE's inverse frequencies (rotated channels / 2,), fp32: base^(-2i/d) over the first
    d = rotary_percent * head_dim channels, with Llama 3.1's scaling if use_rope_scaling."""
    dim = int(cfg.head_dim * cfg.rotary_percent)
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if not cfg.use_rope_scaling:
        return inv_freq
    # Llama 3.1: wavelengths beyond the original context (8192 tokens) slow down by the factor,
    # those under a quarter of it stay, and the band between is interpolated.
    factor, low, high, context = cfg.rope_scaling_factor, 1.0, 4.0, 8192
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(middle, blended, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The channel pair whose wavelength makes `rotations` turns over the original context."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def latent_rotary_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """Multi-latent attention's RoPE over its qk_pos_emb_head_dim channels: (inverse frequencies
    fp32, the factor cos and sin are multiplied by). With YaRN (model.yarn) the pairs that turn
    more than beta_fast times over the original context keep their frequency, those under
    beta_slow turns are divided by rotary_scaling_factor, and a linear ramp blends between."""
    dim = cfg.qk_pos_emb_head_dim
    base = cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    if not cfg.yarn:
        return 1.0 / base, 1.0
    factor, context = cfg.rotary_scaling_factor, cfg.original_max_position_embeddings
    low = max(math.floor(_yarn_correction_dim(cfg.beta_fast, dim, cfg.rotary_base, context)), 0)
    high = min(math.ceil(_yarn_correction_dim(cfg.beta_slow, dim, cfg.rotary_base, context)), dim - 1)
    high = high + 0.001 if low == high else high  # a ramp of one step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp
    inv_freq = 1.0 / (factor * base) * (1 - keep) + 1.0 / base * keep
    return inv_freq, yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)


def apply_rotary(
    x: torch.Tensor,
    inv_freq: torch.Tensor,
    positions: torch.Tensor | None = None,
    interleaved: bool = False,
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """Rotate channel pairs of x (B, T, nh, hd) by angles of the token positions (RoPE).

    The pairs are (i, i + d/2) of the first d = 2 * len(inv_freq) channels, or (2i, 2i+1) if
    `interleaved`; the other channels pass unrotated. positions (B, T): each token's position
    (None: 0..T-1). Angles in fp32, the rotation in x's dtype; cos and sin are multiplied by
    `attention_factor` (YaRN's, see latent_rotary_frequencies).
    """
    T, rotated_channels = x.shape[1], 2 * inv_freq.numel()
    if positions is None:
        positions = torch.arange(T, device=x.device)
    angles = (positions.to(torch.float32).unsqueeze(-1) * inv_freq).unsqueeze(-2)  # (B or 1, T, 1, d/2): every head
    cos, sin = (angles.cos() * attention_factor).to(x.dtype), (angles.sin() * attention_factor).to(x.dtype)
    x, passed = x[..., :rotated_channels], x[..., rotated_channels:]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated
