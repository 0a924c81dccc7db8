"""A MoE layer's experts: E feed-forward networks held as stacked parameters.

Each expert is Megatron's MLP (linear_fc1 -> SwiGLU or GeLU -> linear_fc2) and its weights keep
Megatron's per-expert shapes, stacked on a leading expert axis: fc1_weight (E, ffn or 2 * ffn, h),
with SwiGLU's rows laid out [gate; fc1], and fc2_weight (E, h, ffn). Expert parallelism shards that
leading axis (dtgpt.parallel); the module then holds, and computes, only its own experts.

The input is one tensor of tokens sorted by expert (a dispatcher's output, dtgpt.moe.dispatch)
with the count each expert received. `grouped_gemm=True` runs all experts in one
`torch._grouped_mm` per projection; False runs a plain loop over experts, the oracle the grouped
path is tested against (equal in fp32). What `torch._grouped_mm` asks of its inputs, measured on
CPU with torch 2.13, and how this module meets it:

- int32 offsets (the cumulative counts): built here from the int64 counts;
- every stride a multiple of 16 bytes (so hidden and ffn sizes a multiple of 4 in fp32, 8 in
  bf16/fp16): other sizes are zero-padded, which adds exact zeros to every product;
- rows past the last offset come back as garbage: the counts must sum to the rows given (the
  dispatchers guarantee it, padding to capacity included);
- backward needs a dense incoming gradient (the zero-stride gradient of a `.sum()` raises
  "Invalid strides/sizes", as does an empty one with zero strides): a hook makes it dense.

Experts that receive no tokens get zero gradients on both paths (never None), so every rank's
gradient reductions see the same parameters whatever the routing.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial
from torch.utils.checkpoint import checkpoint

from dtgpt.discard import discard_until_backward
from dtgpt.inits import named_normal
from dtgpt.mlp import SwiGLU

_GEMM_ALIGNMENT_BYTES = 16


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts, as a plain tensor (dtgpt.parallel.expert shards them over ep).

    Every rank computes on its own tokens (each tp rank on its sequence chunk), so where a
    parameter is replicated (over tp) its gradients are partial sums over the replicas.
    """
    if not isinstance(param, DTensor):
        return param
    return param.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in param.placements])


def _dense_grad(grad: torch.Tensor) -> torch.Tensor:
    # An empty tensor counts as contiguous whatever its strides, and grouped_mm rejects zero strides.
    return grad if grad.is_contiguous() and grad.numel() else grad.new_empty(grad.shape).copy_(grad)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (M, k) sorted by expert, weight (E, n, k) -> (M, n): rows offsets[e-1]:offsets[e] use weight[e]."""
    k, n = x.shape[1], weight.shape[1]
    align = _GEMM_ALIGNMENT_BYTES // x.element_size()
    pad_k, pad_n = -k % align, -n % align
    if pad_k or pad_n:
        x, weight = F.pad(x, (0, pad_k)), F.pad(weight, (0, pad_k, 0, pad_n))
    y = torch._grouped_mm(x.contiguous(), weight.transpose(-2, -1), offs=offsets)
    if y.requires_grad:
        y.register_hook(_dense_grad)
    return y[:, :n] if pad_n else y


@torch.compiler.disable
def looped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """grouped_linear as a loop over experts (counts on the host; a tensor is copied there). Every
    expert is visited, even with no rows, so that each gets a (zero) gradient. Run eager under
    torch.compile: the slice sizes are the routing's, and a graph that saw them would be
    specialised on them and recompiled at every step."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    return torch.cat([rows @ w.t() for rows, w in zip(x.split(counts), weight.unbind(0))])


class GroupedExperts(nn.Module):
    """E expert MLPs as stacked parameters (shapes in the module docstring), run on tokens sorted by expert."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        swiglu: bool,
        bias: bool,
        grouped_gemm: bool,
        init_std: float,
        output_init_std: float,
        gelu_approximation: str = "none",
        glu: SwiGLU = SwiGLU(),
    ):
        super().__init__()
        fc1_rows = 2 * ffn_hidden_size if swiglu else ffn_hidden_size
        self.num_experts, self.ffn_hidden_size = num_experts, ffn_hidden_size
        self.swiglu, self.grouped_gemm, self.gelu_approximation = swiglu, grouped_gemm, gelu_approximation
        self.glu = glu  # SwiGLU's offset and clamp (dtgpt/mlp.py)
        self.init_std, self.output_init_std = init_std, output_init_std
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, fc1_rows, hidden_size))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, fc1_rows)) if bias else None
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.recompute_activation = False
        """Megatron's 'moe_act' recomputation (dtgpt.parallel.recompute_modules)."""

    # -- initialisation ------------------------------------------------------------------------

    def init_stds(self) -> dict[str, float]:
        """Parameter name -> the std of its normal init; 0.0: zeros (the biases)."""
        stds = {"fc1_weight": self.init_std, "fc2_weight": self.output_init_std}
        if self.fc1_bias is not None:
            stds.update(fc1_bias=0.0, fc2_bias=0.0)
        return stds

    @torch.no_grad()
    def init_weights(
        self,
        seed: int,
        device: torch.device | str = "cpu",
        assign: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        prefix: str = "",
    ) -> None:
        """Give every parameter its initial value, as dtgpt.model.GPT.init_weights does.

        Each full (all experts) tensor is drawn from a generator seeded by (seed, prefix + name),
        whatever share of the experts this module holds, so every layout starts from the same
        weights; `assign(param, full_value)` writes this rank's slice of it (default: the whole).
        `prefix` is the module's name in its model ("layers.0.mlp.experts.").
        """
        device = torch.device(device)
        for name, std in self.init_stds().items():
            param = getattr(self, name)
            shape = (self.num_experts, *param.shape[1:])
            if std == 0.0:
                value = torch.zeros(shape, device=device)
            else:
                value = named_normal(prefix + name, shape, std, seed, device)
            if assign is not None:
                assign(param, value)
            elif param.shape[0] == self.num_experts:
                param.copy_(value)
            else:
                raise ValueError(f"{name} holds {param.shape[0]} of {self.num_experts} experts: pass `assign`")

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor, counts_on_host: list[int] | None = None
    ) -> torch.Tensor:
        """x_sorted (M, h), rows grouped by expert in order; tokens_per_expert (E_local,) int64 -> (M, h).

        counts_on_host: tokens_per_expert as the host knows it without a sync (a dispatcher's
        capacity or its exchanged sizes). The loop needs the counts on the host to slice the rows:
        without them it copies them there, one host sync per call (the grouped GEMM never does)."""
        w1, w2 = _local(self.fc1_weight), _local(self.fc2_weight)
        if self.grouped_gemm:
            offsets = tokens_per_expert.cumsum(0).to(torch.int32)
            linear = lambda rows, w: grouped_linear(rows, w, offsets)  # noqa: E731
        else:
            counts = counts_on_host
            if counts is None:  # compiled, the counts stay a tensor up to the eager loop
                counts = tokens_per_expert if torch.compiler.is_compiling() else tokens_per_expert.tolist()
            linear = lambda rows, w: looped_linear(rows, w, counts)  # noqa: E731
        h = linear(x_sorted, w1)  # (M, ffn or 2 * ffn)
        if self.fc1_bias is not None:
            h = h + self._per_row(self.fc1_bias, tokens_per_expert, x_sorted.shape[0])
        if self.recompute_activation:  # Megatron's 'moe_act': keep fc1's output, not the activation's
            a = checkpoint(self.activation, h, use_reentrant=False)
            y = linear(a, w2)  # (M, h)
            discard_until_backward([a], lambda: [self.activation(h)], y)
        else:
            y = linear(self.activation(h), w2)  # (M, h)
        if self.fc2_bias is not None:
            y = y + self._per_row(self.fc2_bias, tokens_per_expert, x_sorted.shape[0])
        return y

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU of fc1's [gate; up] output, or GeLU."""
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.glu(gate, up)
        return F.gelu(h, approximate=self.gelu_approximation)

    @staticmethod
    def _per_row(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
        """(E_local, n) -> (rows, n): each row gets its expert's bias (output_size: no host sync)."""
        return _local(bias).repeat_interleave(tokens_per_expert, dim=0, output_size=rows)

    def extra_repr(self) -> str:
        e, ffn = self.num_experts, self.ffn_hidden_size
        act = "swiglu" if self.swiglu else "gelu"
        return f"experts={e}, ffn={ffn}, {act}, bias={self.fc1_bias is not None}, grouped_gemm={self.grouped_gemm}"

