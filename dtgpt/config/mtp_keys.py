"""The multi-token prediction keys of [model] (DeepSeek-V3's MTP), with Megatron-LM's names,
defaults and meanings. A base of ModelConfig (dtgpt/config/sections.py), as MoEKeys is; the
rules are check_mtp's (below), the modules dtgpt/mtp.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class MTPKeys:
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depth: modules after the last block, the k-th predicting the token
    k + 1 ahead from the (k-1)-th's output and the embedding of the token k ahead; unset: none."""
    mtp_loss_scaling_factor: float = 0.1
    """The mean of the prediction modules' losses, times this, is added to the LM loss for the
    gradient (the logged loss stays the LM loss; each depth's loss is logged beside it)."""

    @property
    def mtp_depth(self) -> int:
        """How many prediction modules the model has (0: none)."""
        return self.mtp_num_layers or 0
