"""The per-token tensors of a batch, with Megatron's end-of-document options.

A sample is seq_length + 1 token ids; its inputs are the first seq_length, its labels the last
seq_length. Megatron's GPTDataset derives three more things from the *input* tokens and the eod
id, and dtgpt derives the same, on the full sequence (before any split over context-parallel
ranks, so every option composes with it):

- `eod_mask_loss`: no loss where the input token is the eod (the label there is the first token
  of the next document); the label becomes IGNORE_INDEX, so the loss normaliser, which counts
  the labels that are not IGNORE_INDEX, counts only the unmasked tokens.
- `reset_position_ids`: positions restart at 0 on the token after each eod.
- `reset_attention_mask`: a token attends only to earlier tokens of its own document. The eod
  ends its document: it belongs to the document before it. `document_ids` numbers the
  documents of a sample 0, 1, ...; the model turns them into its attention mask. Where each
  document starts is counted here too, on the host (`document_bounds`): on CUDA the model runs
  flash attention's varlen kernel over the documents with them, no mask and no host sync
  (dtgpt/attention_varlen.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import torch

from dtgpt.attention_varlen import DocumentBounds, Documents

IGNORE_INDEX = -100
"""The label of a token that carries no loss (cross-entropy's ignore_index)."""


def loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many tokens of `labels` count toward the loss (eod_mask_loss leaves some out)."""
    return (labels != IGNORE_INDEX).sum().to(torch.float32)


@dataclass(frozen=True)
class TokenOptions:
    """Megatron's three per-token switches (`[data]`) and the eod id they look for."""

    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @classmethod
    def from_config(cls, data_cfg, eod: int) -> "TokenOptions":
        return cls(eod, data_cfg.eod_mask_loss, data_cfg.reset_position_ids, data_cfg.reset_attention_mask)


@dataclass
class Batch:
    """Inputs (B, T) and labels (B, T); position_ids and document_ids (B, T) where an option asks
    for them (None: positions 0..T-1, plain causal attention); token_index (B, T) where the model
    keys dropout on it (dtgpt.step adds it: each token's index in the run); document_bounds
    beside document_ids, where the documents start in the whole sequences (it moves to the
    tokens' device and is never cut along the sequence: under cp it still describes whole rows)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    document_ids: Optional[torch.Tensor] = None
    token_index: Optional[torch.Tensor] = None
    document_bounds: Optional[DocumentBounds] = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        """The same batch with `fn` applied to every tensor it holds (to a device, a cp chunk, ...)."""
        mapped = replace(self, **{f.name: fn(t) for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)})
        if self.document_bounds is None:
            return mapped
        return replace(mapped, document_bounds=self.document_bounds.to(mapped.tokens.device))

    def chunk(self, n: int) -> list["Batch"]:
        """n micro-batches along the batch dimension."""
        if n == 1:  # the batch itself: chunking each tensor once would cost five view ops apiece
            return [self]
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        split = {k: (t.chunk(n) if t is not None else [None] * n) for k, t in parts.items()}
        return [Batch(**{k: split[k][i] for k in parts}) for i in range(n)]

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments every model part takes besides its activations."""
        inputs = {k: t for k in ("position_ids", "document_ids", "token_index") if (t := getattr(self, k)) is not None}
        if self.document_bounds is not None:
            inputs["document_ids"] = Documents(self.document_ids, self.document_bounds)
        return inputs

    def pin_memory(self) -> "Batch":
        return self.map(torch.Tensor.pin_memory)


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(B, T) -> the document of each token: the number of eods strictly before it."""
    is_eod = (tokens == eod).long()
    return is_eod.cumsum(dim=1) - is_eod


def reset_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(B, T) -> each token's position within its document (0 right after an eod)."""
    T = tokens.shape[1]
    index = torch.arange(T, device=tokens.device).expand_as(tokens)
    # A document starts one past the latest eod before the token (0 if none).
    after_eod = torch.where(tokens == eod, index + 1, 0)
    starts = after_eod.cummax(dim=1).values
    starts = torch.cat([torch.zeros_like(starts[:, :1]), starts[:, :-1]], dim=1)
    return index - starts


def build_batch(samples: torch.Tensor, options: Optional[TokenOptions] = None) -> Batch:
    """(B, T + 1) sample tokens -> the Batch the model trains on (options None: all off)."""
    tokens, labels = samples[:, :-1], samples[:, 1:]
    if options is None:
        return Batch(tokens, labels)
    if options.eod_mask_loss:
        labels = labels.masked_fill(tokens == options.eod, IGNORE_INDEX)
    positions = reset_position_ids(tokens, options.eod) if options.reset_position_ids else None
    documents = document_ids(tokens, options.eod) if options.reset_attention_mask else None
    bounds = DocumentBounds.of(documents) if documents is not None else None
    return Batch(tokens, labels, positions, documents, document_bounds=bounds)
