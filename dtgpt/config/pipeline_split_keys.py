"""Megatron-LM's keys of an uneven pipeline split, in [parallel], with Megatron's names, defaults
and meanings. A base of ParallelConfig (dtgpt/config/sections.py), as MoEKeys is of ModelConfig;
the layer counts they give and their rules are dtgpt/config/pipeline_split.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class PipelineSplitKeys:
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Transformer layers of the first pp rank (shared equally by its virtual stages); the other
    ranks split the rest evenly. Unset: an even split."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Transformer layers of the last pp rank, as decoder_first_pipeline_num_layers."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting evenly: the first stage builds one
    transformer layer fewer."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the loss (final norm and head) as one layer: the last stage builds one fewer."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual stage: sets virtual_pipeline_stages_per_rank to the layers of a pp rank
    divided by it (Megatron's older spelling of --num-virtual-stages-per-pipeline-rank)."""
    pipeline_model_parallel_layout: str = ""
    """Megatron's layout string, e.g. 'Et*3|(tt|)*29,m|L': one group per stage in stage order
    (vp-major: virtual stage v of pp rank r is stage v * pp + r), E the embedding, t a
    transformer layer, m a multi-token prediction module, L the loss and head; `(...)*N` and
    `x*N` repeat, commas are cosmetic. Sets virtual_pipeline_stages_per_rank. Empty: unset."""
