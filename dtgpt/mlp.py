"""The dense block's MLP: Megatron's fc1 -> activation -> fc2 (GeLU, squared ReLU or SwiGLU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtgpt.config import ModelConfig
from dtgpt.inits import DeclaredInits, Init, linear_inits


@dataclass(frozen=True)
class SwiGLU:
    """silu(gate) * (up + offset), gate clamped to at most `clamp` and up to [-clamp, clamp] first
    (Megatron's glu_linear_offset and activation_func_clamp_value; gpt-oss's clamped unit)."""

    offset: float = 0.0
    clamp: float | None = None

    @classmethod
    def of(cls, cfg: ModelConfig) -> "SwiGLU":
        return cls(cfg.glu_linear_offset, cfg.activation_func_clamp_value)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:
            gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
        return F.silu(gate) * (up + self.offset if self.offset else up)


class MLP(nn.Module):
    """fc2(gelu(fc1(x))) or fc2(relu(fc1(x))^2) (squared_relu), or with swiglu fc2(silu(gate(x)) * fc1(x))
    (Megatron's fc1 holds [gate; fc1] in one matrix; two here, so that each splits over tp on its own)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=cfg.add_bias_linear) if cfg.swiglu else None
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=cfg.add_bias_linear)
        self.fc2 = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.add_bias_linear)
        self.gelu_approximation, self.squared_relu = cfg.gelu_approximation, cfg.squared_relu
        self.swiglu = SwiGLU.of(cfg)

    def declared_inits(self) -> DeclaredInits:
        inits = linear_inits(self.fc1, Init.NORMAL) + linear_inits(self.fc2, Init.SCALED_NORMAL)
        return inits + (linear_inits(self.gate, Init.NORMAL) if self.gate is not None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.fc2(self.swiglu(self.gate(x), self.fc1(x)))
        if self.squared_relu:
            return self.fc2(F.relu(self.fc1(x)).square())
        return self.fc2(F.gelu(self.fc1(x), approximate=self.gelu_approximation))
