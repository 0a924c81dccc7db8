"""The rules of [model]'s initialisation keys: init_method_std, embedding_init_method_std and
init_method_xavier_uniform (Megatron's --init-method-std, --embedding-init-method-std and
--init-method-xavier-uniform); the init itself is dtgpt.inits.initial_draw."""

from __future__ import annotations

from dtgpt.config.sections import Config
from dtgpt.config.sections import require as _require


def check_init(cfg: Config) -> None:
    m = cfg.model
    _require(m.init_method_std > 0, f"model.init_method_std={m.init_method_std} must be > 0")
    std = m.embedding_init_method_std
    _require(std is None or std > 0, f"model.embedding_init_method_std={std} must be > 0 (unset: model.init_method_std)")
    # Megatron's experts are one matrix each; dtgpt stacks them, and which fan a stacked tensor's
    # xavier_uniform takes is not yet built (nor checked against Megatron's grouped experts).
    _require(
        not (m.init_method_xavier_uniform and m.num_experts),
        f"model.init_method_xavier_uniform=true with model.num_experts={m.num_experts}: xavier_uniform is built "
        "for dense models only",
    )
