"""Which parameters megatron-core 0.16.1's Muon builder (get_megatron_muon_optimizer) gives Muon,
on its GPTModel: run inside tests/megatron_gpt.py's `family` launch (tp 2), read by
tests/test_megatron_family.py, which asks dtgpt's optimizer the same of dtgpt's model."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

MUON_ARCHS = (("gpt", False), ("rope", False), ("llama", True), ("options", False))
"""(architecture of tests/megatron_gpt.py, untied head): learned positions, tied and untied heads, grouped-query
attention and SwiGLU, qk-layernorm and a QKV bias."""


def write_muon_params(path: Path) -> None:
    """path: {arch: {"muon": [names], "qkv": [names split by QKV]}}, Megatron's parameter names;
    nothing when emerging-optimizers (the builder's dependency) is not installed, or on another
    megatron-core than 0.16.1."""
    from megatron.core.package_info import __version__

    from tests.muon_oracle import EMERGING_OPTIMIZERS, load

    if not EMERGING_OPTIMIZERS.is_dir() or __version__ != "0.16.1":  # the builder's signature is 0.16's
        return
    muon = load()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests.megatron_adam import patch_for_optimizer
    from tests.megatron_gpt import LAYERS, build

    patch_for_optimizer()
    found = {}
    for arch, untied in MUON_ARCHS:
        model = build(dist.get_world_size(), untied, LAYERS, arch)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        chained = muon.get_megatron_muon_optimizer(OptimizerConfig(lr=1e-3, min_lr=0.0), [ddp])
        names = {id(p): name.removeprefix("module.") for name, p in ddp.named_parameters()}
        given = [p for group in chained.chained_optimizers[0].optimizer.param_groups for p in group["params"]]
        found[arch] = {"muon": sorted(names[id(p)] for p in given), "qkv": sorted(names[id(p)] for p in given if getattr(p, "is_qkv", False))}
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        path.write_text(json.dumps(found, indent=1))
