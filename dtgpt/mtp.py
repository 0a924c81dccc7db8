"""Multi-token prediction (DeepSeek-V3's MTP) as megatron-core builds it, in plain single-device
PyTorch: `model.mtp_num_layers` modules after the last block, on the last pipeline stage.

Module k (from 1) predicts the token k + 1 ahead of each position. It takes the (k-1)-th's output
(for k = 1 the main model's output after its final norm) and the embedding of the input tokens
shifted k to the left (the shared word embedding; the last k positions see token 0 and carry no
loss), normalises each (`enorm` the embedding, `hnorm` the hidden state), projects their
concatenation [embedding, hidden] back to the hidden size (`eh_proj`, no bias), runs one
transformer block of the model's kind (the last block's: MLA, MoE as configured), normalises
(`final_layernorm`, whose output is also the next module's input) and reads the logits with the
shared output head. Parameter names are Megatron's (mtp.layers.<i>.enorm.weight, ...).

The loss (dtgpt.parallel.model_parts.GlobalBatchLoss with an MTPLoss): depth k's labels are the
labels shifted k to the left (IGNORE_INDEX at the end), its cross-entropy is normalised as the
LM loss is, and the mean over depths times mtp_loss_scaling_factor is added to the LM loss for
the gradient only: the loss a run reports stays the LM loss, each depth's is logged beside it
(`mtp_<k> loss`, Megatron's name: the mean of its micro-batch means over the global batch).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from dtgpt.config import ModelConfig
from dtgpt.data.batch import IGNORE_INDEX, loss_tokens
from dtgpt.inits import DeclaredInits, Init, linear_inits
from dtgpt.norms import build_norm, norm_inits


def shift_left(t: torch.Tensor, fill: int) -> torch.Tensor:
    """(B, T) -> each row one place to the left, `fill` in its last place (Megatron's roll_tensor)."""
    rolled = t.roll(-1, dims=-1)
    rolled[..., -1] = fill
    return rolled


class SequenceShift:
    """How the prediction modules shift a per-token tensor one place left and count tokens, on a
    sequence this process holds whole. Under context parallelism each rank holds two chunks of
    it and dtgpt.parallel.context_shift's subclass takes over (the same values, exchanged)."""

    def __call__(self, t: torch.Tensor, fill: int) -> torch.Tensor:
        return shift_left(t, fill)

    def total(self, counts: torch.Tensor) -> torch.Tensor:
        """Token counts of this process's part of the sequences -> those of the whole sequences."""
        return counts


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, transformer_layer: nn.Module):
        """transformer_layer: a block of the model's kind (built by dtgpt.model)."""
        super().__init__()
        self.enorm = build_norm(cfg)
        self.hnorm = build_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.transformer_layer = transformer_layer
        self.final_layernorm = build_norm(cfg)

    def declared_inits(self) -> DeclaredInits:
        norms = norm_inits(self.enorm) + norm_inits(self.hnorm) + norm_inits(self.final_layernorm)
        return norms + linear_inits(self.eh_proj, Init.NORMAL)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, **per_token) -> torch.Tensor:
        """hidden, embedded (B, T, C) -> this depth's output (B, T, C), after its final norm."""
        h = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))  # from (B, T, 2C)
        return self.final_layernorm(self.transformer_layer(h, **per_token))


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg: ModelConfig, transformer_layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(cfg, block) for block in transformer_layers)
        self.shift = SequenceShift()

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embedding: Callable[..., torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """The main model's output after its final norm (B, T, C) and the input token ids (B, T)
        -> the logits of each depth. As Megatron, the shifted positions reach only the embedding
        (learned positions); the blocks' RoPE keeps the unshifted ones."""
        B, T = input_ids.shape
        positions = position_ids if position_ids is not None else torch.arange(T, device=input_ids.device).expand(B, T)
        logits = []
        for layer in self.layers:
            input_ids, positions = self.shift(input_ids, 0), self.shift(positions, 0)
            embedded = embedding(input_ids, positions, token_index)
            hidden = layer(hidden, embedded, position_ids=position_ids, document_ids=document_ids, token_index=token_index)
            logits.append(head(hidden))
        return logits


def named_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Every transformer block a GPT (or pipeline stage) holds, by module name: the model's
    (layers.<i>), then the prediction modules' (mtp.layers.<k>.transformer_layer)."""
    blocks = {f"layers.{name}": block for name, block in model.layers.items()}
    if model.mtp is not None:
        blocks.update({f"mtp.layers.{k}.transformer_layer": layer.transformer_layer for k, layer in enumerate(model.mtp.layers)})
    return blocks


def numbered_blocks(model: nn.Module) -> dict[int, nn.Module]:
    """named_blocks by global number: the model's 0..L-1, then the prediction modules' L, L+1,
    ... (as Megatron numbers their routers)."""
    blocks = {int(name): block for name, block in model.layers.items()}
    if model.mtp is not None:
        blocks.update({model.cfg.num_layers + k: layer.transformer_layer for k, layer in enumerate(model.mtp.layers)})
    return blocks


def depth_labels(labels: torch.Tensor, depth: int, shift: SequenceShift = SequenceShift()) -> list[torch.Tensor]:
    """(B, T) labels -> those of depths 1..depth: shifted 1..depth places left, IGNORE_INDEX after."""
    shifted = []
    for _ in range(depth):
        labels = shift(labels, IGNORE_INDEX)
        shifted.append(labels)
    return shifted


class _AddedGradient(torch.autograd.Function):
    """Identity on `loss`; in backward, `extra` gets the gradient `loss` gets (as if added to it)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad


def with_added_gradient(loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """`loss` as it is, whose backward also runs `extra`'s (Megatron's MTPLossAutoScaler)."""
    return _AddedGradient.apply(loss, extra)


class MTPLoss:
    """The prediction modules' loss terms, and their per-depth sums for the log.

    `totals` (depth,): each depth's micro-batch means summed since the last `take()`;
    `counting`: False while the loss is taken of stand-in outputs (a pipeline stage inferring its
    shapes), which must not be counted."""

    def __init__(self, cfg: ModelConfig, shift: SequenceShift | None = None):
        self.depth = cfg.mtp_depth
        self.shift = shift or SequenceShift()
        self.weight = cfg.mtp_loss_scaling_factor / self.depth
        self.totals: torch.Tensor | None = None
        self.counting = True

    def term(
        self,
        logits: list[torch.Tensor],
        labels: torch.Tensor,
        cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        denominator: torch.Tensor,
        per_micro_batch: bool,
    ) -> torch.Tensor:
        """The term added to one micro-batch's LM loss for the gradient: weight * sum over depths
        of (sum of token losses / denominator), where a per-micro-batch denominator (Megatron's
        default loss) is multiplied by the depth's own loss-token count."""
        term, means = None, []
        targets = depth_labels(labels, self.depth, self.shift)
        # Each depth's loss tokens in the whole sequences (under cp each rank holds a part of them).
        counts = self.shift.total(torch.stack([loss_tokens(target) for target in targets])).clamp(min=1)
        for depth_logits, target, count in zip(logits, targets, counts):
            loss_sum = cross_entropy(depth_logits, target)
            means.append((loss_sum / count).detach())
            part = loss_sum / (denominator * count if per_micro_batch else denominator)
            term = part if term is None else term + part
        self._count(torch.stack(means).float())
        return term * self.weight

    def _count(self, means: torch.Tensor) -> None:
        if not self.counting:
            return
        self.totals = means if self.totals is None else self.totals + means

    def take(self, device: torch.device) -> torch.Tensor:
        """(depth,) the sums since the last call (zeros where no loss was computed here)."""
        totals, self.totals = self.totals, None
        return totals.to(device) if totals is not None else torch.zeros(self.depth, device=device)


def mtp_loss_key(depth: int) -> str:
    """Megatron's name of depth `depth`'s logged loss (from 1)."""
    return f"mtp_{depth} loss"


def with_mtp_shares(model, vector: torch.Tensor | None) -> torch.Tensor | None:
    """The iteration's statistics vector (or None) with this rank's per-depth sums appended, for
    the step's one all-reduce; `model` is the ModelParts. tp ranks hold the same losses: only tp
    rank 0 contributes them."""
    if model.mtp_loss is None:
        return vector
    shares = model.mtp_loss.take(model.device)
    if model.dims.tp_rank != 0:
        shares = torch.zeros_like(shares)
    return shares if vector is None else torch.cat([vector, shares])


def mtp_summary(model, reduced: list[float], microbatches: int) -> tuple[list[float], dict[str, float]]:
    """(the reduced values less the per-depth sums, each depth's logged loss): the mean of its
    micro-batch means over the micro-batches of every data-parallel rank, as Megatron logs it."""
    depth = model.mtp_loss.depth
    sums = reduced[len(reduced) - depth :]
    return reduced[: len(reduced) - depth], {mtp_loss_key(k + 1): s / (microbatches * model.dims.dp) for k, s in enumerate(sums)}
