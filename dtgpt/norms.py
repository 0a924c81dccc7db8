"""The norms of the GPT family: LayerNorm and RMSNorm in the parameters' dtype, with Megatron's
apply_layernorm_1p (the weight stored as gamma - 1)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtgpt.config import ModelConfig
from dtgpt.inits import DeclaredInits, Init


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose output has its parameters' dtype, whatever its input's: under fp16/bf16
    with fp32_residual_connection the residual stream is fp32 and the block computes in the
    parameters' dtype. Statistics are fp32 inside the op either way. With `one_plus`
    (apply_layernorm_1p) the stored weight is gamma - 1."""

    def __init__(self, size: int, eps: float, one_plus: bool = False):
        super().__init__(size, eps=eps)
        self.one_plus = one_plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.one_plus else self.weight
        bias = self.bias.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, weight.to(x.dtype), bias, self.eps).to(self.weight.dtype)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose output has its parameters' dtype (as LayerNorm, `one_plus` included)."""

    def __init__(self, size: int, eps: float, one_plus: bool = False):
        super().__init__(size, eps=eps)
        self.one_plus = one_plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.one_plus else self.weight
        return F.rms_norm(x, self.normalized_shape, weight.to(x.dtype), self.eps).to(self.weight.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its root mean square along the last dim, in fp32, no weight (Megatron's qk_l2_norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


def build_norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    """model.normalization over `size` channels (default: the hidden size)."""
    norm = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return norm(size or cfg.hidden_size, eps=cfg.norm_epsilon, one_plus=cfg.apply_layernorm_1p)


def norm_inits(norm: nn.Module) -> DeclaredInits:
    """A norm starts as the identity: scale one (stored zero if one_plus), shift (LayerNorm only) zero."""
    inits = [(norm.weight, Init.ZEROS if norm.one_plus else Init.ONES)]
    if getattr(norm, "bias", None) is not None:
        inits.append((norm.bias, Init.ZEROS))
    return inits
