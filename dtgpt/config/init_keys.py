"""The init keys of [model] beyond init_method_std (Megatron-LM's --embedding-init-method-std and
--init-method-xavier-uniform), with Megatron's names and meanings. A base of ModelConfig
(dtgpt/config/sections.py), as MTPKeys is; the rules are check_init's (dtgpt/config/init_rules.py),
the draws dtgpt.inits'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class InitKeys:
    embedding_init_method_std: Optional[float] = None
    """Std of the word and position embeddings' normal init (unset: init_method_std): dtgpt.inits.Init.EMBEDDING."""
    init_method_xavier_uniform: bool = False
    """Every weight drawn from N(0, init_method_std) or its scaled output form draws from xavier_uniform
    instead (embeddings too, unless embedding_init_method_std differs from init_method_std)."""
