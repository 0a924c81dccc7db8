"""Rotary position embeddings (RoPE) as Megatron-LM computes them: its frequencies (Llama 3.1's
scaling included), its two channel-pair conventions, and a rotated fraction of each head."""

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


def apply_rotary(
    x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor | None = None, interleaved: bool = False
) -> torch.Tensor:
    """Rotate channel pairs of x (B, T, nh, hd) by angles of the token positions (RoPE).

    The pairs are (i, i + d/2) of the first d = 2 * len(inv_freq) channels, or (2i, 2i+1) if
    `interleaved`; the other channels pass unrotated. positions (B, T): each token's position
    (None: 0..T-1). Angles in fp32, the rotation in x's dtype.
    """
    T, rotated_channels = x.shape[1], 2 * inv_freq.numel()
    if positions is None:
        positions = torch.arange(T, device=x.device)
    angles = (positions.to(torch.float32).unsqueeze(-1) * inv_freq).unsqueeze(-2)  # (B or 1, T, 1, d/2): every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x, passed = x[..., :rotated_channels], x[..., rotated_channels:]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated
