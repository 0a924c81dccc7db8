"""Attention sinks (Megatron's softmax_type): one more term in every query's softmax denominator.

softmax over [scores of the visible keys, s_h]: 'off-by-one' takes s_h = 0 (e^0 = 1 added to the
denominator), 'learnable' a parameter per head (Megatron's core_attention.softmax_offset). The
sink absorbs probability and contributes no value, so a head may attend to nothing.

SDPA has no such term, so it gets a key that carries it: one extra channel, 1 on a sink key
appended to the keys (zero elsewhere, with a zero value) and s_h / scale on every query of head h
(0 on the real keys), the scale passed explicitly so the real scores keep d ** -0.5. The sink
key is visible to every query. The logit s_h then reaches the softmax through the query, and its
gradient flows back to the parameter the same way. Exact math on any SDPA backend; on CUDA this
is the masked path (a boolean mask, no fused sink kernel here).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtgpt.inits import DeclaredInits, Init


class AttentionSink(nn.Module):
    """The learned sink logit of each head, `softmax_offset` (nh,), drawn as Megatron's: normal with
    init_method_std. A module of its own, on the attention beside its core (which stays parameter-free, so
    recomputation and cp may swap or wrap it): under tp it holds this rank's heads (dtgpt.parallel.tensor)."""

    def __init__(self, heads: int):
        super().__init__()
        self.softmax_offset = nn.Parameter(torch.empty(heads))

    def declared_inits(self) -> DeclaredInits:
        return [(self.softmax_offset, Init.NORMAL)]

    def forward(self) -> torch.Tensor:
        return self.softmax_offset


def attend_with_sink(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, dropout: float = 0.0
) -> torch.Tensor:
    """q (B, nh, Tq, hd) over k, v (B, ng, Tk, hd / dv) with the boolean mask (Tq, Tk) or (B, 1, Tq, Tk)
    and one sink logit per head, sink (nh,) -> (B, nh, Tq, dv)."""
    B, nh, Tq, hd = q.shape
    scale = hd**-0.5
    carried = (sink / scale).to(q.dtype).view(1, nh, 1, 1).expand(B, nh, Tq, 1)
    q = torch.cat((q, carried), dim=-1)  # (B, nh, Tq, hd + 1)
    sink_key = F.pad(k.new_ones(B, k.shape[1], 1, 1), (hd, 0))  # (B, ng, 1, hd + 1): 1 in the last channel only
    k = torch.cat((F.pad(k, (0, 1)), sink_key), dim=2)  # (B, ng, Tk + 1, hd + 1)
    v = torch.cat((v, v.new_zeros(B, v.shape[1], 1, v.shape[3])), dim=2)  # (B, ng, Tk + 1, dv)
    mask = torch.cat((mask, mask.new_ones(*mask.shape[:-1], 1)), dim=-1)  # the sink: seen by every query
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=k.shape[1] != nh
    )
