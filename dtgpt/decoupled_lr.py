"""Megatron's --decoupled-lr: the word embedding and the output layer train at their own peak and
minimum LR (optimizer.decoupled_lr, decoupled_min_lr), on the schedule of every other parameter
(the same warmup, decay style and lengths: dtgpt.optim.LRSchedule).

Which parameters: Megatron's `is_embedding_or_output_parameter`, the word embedding and the
output layer's weight. Position embeddings are not among them. Wherever a copy of the word
embedding lives it is one of them: the last pipeline stage's tied head (`output.weight`) and
multi-token prediction's copy there (`embedding.word.weight`) are summed with the first stage's
every step (dtgpt.parallel.tied), so they must move at its LR to stay equal.

They get an AdamW group of their own, marked DECOUPLED, built only when decoupled_lr is set (so
a run without it keeps Megatron's two groups) and only by a model part that holds one of them: a
pipeline stage with neither end has no such group (dtgpt.optim.build_optimizer builds no empty
group, since torch's flattened optimizer state dict cannot load into one)."""

from __future__ import annotations

from torch import nn

EMBEDDING_OR_OUTPUT = ("embedding.word.weight", "output.weight")
"""The parameter names (the model's, unchanged by FSDP, TP or compile) of the word embedding and the output layer."""

DECOUPLED = "decoupled_lr"
"""The param-group key that marks the embedding-and-output group (LRSchedule gives it its bounds)."""


def is_embedding_or_output(name: str) -> bool:
    return name in EMBEDDING_OR_OUTPUT


def decoupled_group(params: list[nn.Parameter], weight_decay: float) -> dict:
    """The embedding-and-output group. Its weights are matrices, so they decay (Megatron's
    weight-decay rule and its decoupled group combine so)."""
    return {"params": params, "weight_decay": weight_decay, DECOUPLED: True}
