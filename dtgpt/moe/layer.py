"""The MoE layer: router -> dispatcher -> experts -> combine, plus the shared expert, in place of
a block's MLP (dtgpt/model.py picks one per model.moe_layer_freq).

Plain single-device PyTorch. The router's auxiliary losses (dtgpt/moe/router.py) train as
Megatron trains them: not added to the LM loss (a pipeline's last stage never sees them) but
attached to the layer's output, so that backward adds d(loss)/d(router) times `aux_loss_scale`,
which dtgpt.step sets once per global batch to the LM loss's own scale over the global batch's
micro-batch count (Megatron: the loss scale over num_microbatches, averaged over dp).
The gradient reaches the router's logits only: the router weights and, through them, the
layer's input, never the experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from dtgpt.config import ModelConfig
from dtgpt.inits import DeclaredInits, Init
from dtgpt.mlp import SwiGLU
from dtgpt.moe.dispatch import LocalDispatcher
from dtgpt.moe.experts import GroupedExperts
from dtgpt.moe.router import Router, Routing


class _LossGradient(torch.autograd.Function):
    """Identity on `activation`; in backward, also gives `loss` the gradient `scale`."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.loss_shape, ctx.loss_dtype = scale, loss.shape, loss.dtype
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.loss_shape, ctx.scale, device=grad.device, dtype=ctx.loss_dtype), None


def in_backward() -> bool:
    """Whether autograd is running a backward now: a forward run here is a recomputation
    (non-reentrant checkpointing), whose routing statistics were counted the first time."""
    return torch._C._current_graph_task_id() != -1


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None):
        """shared_expert: the dense MLP every token also goes through (built by dtgpt.model)."""
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(
            num_experts=cfg.num_experts,
            hidden_size=cfg.hidden_size,
            ffn_hidden_size=cfg.expert_ffn_size,
            swiglu=cfg.swiglu,
            bias=cfg.add_bias_linear,
            grouped_gemm=cfg.moe_grouped_gemm,
            init_std=cfg.init_method_std,
            output_init_std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers),
            gelu_approximation=cfg.gelu_approximation,
            glu=SwiGLU.of(cfg),
        )
        # Replaced by an expert-parallel dispatcher with the same methods under EP.
        self.dispatcher = LocalDispatcher(cfg.num_experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.moe_shared_expert_gate and shared_expert is not None:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.aux_loss_scale = 1.0
        self.counting = True
        """False while a pipeline stage infers its shapes on stand-in inputs (dtgpt.moe.stats.uncounted)."""
        self.totals: dict[str, torch.Tensor] = {}
        """This rank's routing statistics since take_totals(): the logged losses (Routing.logged),
        tokens_per_expert (E,) and dropped_tokens, summed over the micro-batches trained."""

    def declared_inits(self) -> DeclaredInits:
        """The experts' weights as Megatron's expert linears: fc1 N(0, std), fc2 the scaled normal,
        biases zero; the shared expert's gate N(0, std)."""
        e = self.experts
        inits = [(e.fc1_weight, Init.NORMAL), (e.fc2_weight, Init.SCALED_NORMAL)]
        inits += [(bias, Init.ZEROS) for bias in (e.fc1_bias, e.fc2_bias) if bias is not None]
        # Megatron draws the shared expert's gate with its init_method, N(0, std)
        return inits + ([(self.shared_expert_gate.weight, Init.NORMAL)] if self.shared_expert_gate is not None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h)."""
        B, T, h = x.shape
        tokens = x.transpose(0, 1).reshape(T * B, h)  # position-major, as Megatron orders them
        training = self.training and torch.is_grad_enabled()
        routing = self.router(tokens, B, weighted=training)
        x_sorted, tokens_per_expert = self.dispatcher.dispatch(
            tokens, routing.probs, routing.routing_map, capacity=routing.capacity, topk=routing.topk
        )
        y = self.experts(x_sorted, tokens_per_expert, self.dispatcher.counts_on_host)
        y = self.dispatcher.combine(y)  # (T * B, h)
        out = y.view(T, B, h).transpose(0, 1)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            out = out + shared
        if routing.loss is not None:
            out = _LossGradient.apply(out, routing.loss, self.aux_loss_scale)
        if training and self.counting and not in_backward():
            self._count(routing)
        return out

    @torch.no_grad()
    def _count(self, routing: Routing) -> None:
        counts = {**routing.logged, "tokens_per_expert": routing.routing_map.sum(0), "dropped_tokens": routing.dropped}
        for name, value in counts.items():
            value = value.detach().float()
            self.totals[name] = self.totals[name] + value if name in self.totals else value

    def take_totals(self) -> dict[str, torch.Tensor]:
        totals, self.totals = self.totals, {}
        return totals
