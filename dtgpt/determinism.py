"""Megatron's --deterministic-mode (`training.deterministic`): the same run gives the same bits.

On CUDA that takes three settings, made before the process group and the first cuBLAS call
read them: torch's deterministic algorithms (an op with no deterministic kernel raises instead of
running a non-deterministic one, as Megatron asserts), cuBLAS's fixed workspace
(CUBLAS_WORKSPACE_CONFIG, which torch requires for deterministic matmuls) and NCCL's ring
algorithm (its reduction order is fixed). A value the user already set is kept if it is one of
the deterministic ones, refused otherwise. On CPU the kernels dtgpt runs are already
deterministic and gloo reduces in a fixed order: nothing is set, and a line says so.
"""

from __future__ import annotations

import os

import torch

from dtgpt.config.sections import ConfigError

ENV_DEFAULTS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
ACCEPTED = {"CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"), "NCCL_ALGO": ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")}
CPU_NOTE = "training.deterministic: on CPU dtgpt's kernels and gloo's reductions are deterministic already; nothing to set"


def apply_determinism(device: torch.device, environ=os.environ) -> str | None:
    """Make this process deterministic on `device`; returns the line to print, if any."""
    if device.type != "cuda":
        return CPU_NOTE
    for name, accepted in ACCEPTED.items():
        value = environ.get(name)
        tokens = [t.strip() for t in (value or "").split(",") if t.strip()]
        if value is not None and not (tokens and all(t in accepted for t in tokens)):
            raise ConfigError(
                f"training.deterministic=true needs {name} unset or one of {', '.join(accepted)}, not {value!r}"
            )
        environ.setdefault(name, ENV_DEFAULTS[name])
    torch.use_deterministic_algorithms(True)
    return None
