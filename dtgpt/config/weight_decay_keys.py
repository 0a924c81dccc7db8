"""The weight-decay schedule keys of [optimizer] (Megatron-LM's --start-weight-decay,
--end-weight-decay and --weight-decay-incr-style), with Megatron's names and meanings. A base of
OptimizerConfig (dtgpt/config/sections.py), as MuonKeys is; the rules are
check_weight_decay_schedule's (dtgpt/config/weight_decay_rules.py), the schedule dtgpt.optim's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass
class WeightDecayKeys:
    start_weight_decay: Optional[float] = None
    """The weight decay at the start of training under a 'linear' or 'cosine' increment (unset
    under 'constant', where optimizer.weight_decay is the decay throughout)."""
    end_weight_decay: Optional[float] = None
    """The weight decay it reaches at the end of training (train_iters x global_batch_size or
    train_samples samples) and keeps after; >= start_weight_decay, as Megatron asserts."""
    weight_decay_incr_style: str = "constant"
    """How the weight decay goes from start to end: 'constant', 'linear' or 'cosine'."""
