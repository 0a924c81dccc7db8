"""megatron-core 0.16.1's Muon builder (get_megatron_muon_optimizer) on its GPTModel, inside the
launches of tests/megatron_gpt.py: which parameters it gives Muon (the `family` launch, tp 2; read
by tests/test_megatron_family.py) and three of its steps (the `sgd` launch; read by tests/test_sgd.py);
and which it gives Muon on the MLA + MoE model of tests/megatron_mla_gpt.py's launch (tp 2; read by
tests/test_megatron_mla_muon.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from tests.muon_oracle import load as load_muon

MUON_ARCHS = (("gpt", False), ("rope", False), ("llama", True), ("options", False))
"""(architecture of tests/megatron_gpt.py, untied head): learned positions, tied and untied heads, grouped-query
attention and SwiGLU, qk-layernorm and a QKV bias."""


MUON = dict(muon_momentum=0.9, muon_use_nesterov=True, muon_fp32_matmul_prec="high")
"""The Muon keys of the three steps beside tests/megatron_adam.py's ADAM ones: Megatron-LM's
--muon-momentum default (OptimizerConfig's own is 0.95; Megatron-LM passes its flag's 0.9),
Nesterov, and the Newton-Schulz iteration in fp32 (the two sides' gradients differ by rounding,
which bf16 would round up)."""


def available() -> bool:
    from megatron.core.package_info import __version__

    from tests.muon_oracle import EMERGING_OPTIMIZERS

    return EMERGING_OPTIMIZERS.is_dir() and __version__ == "0.16.1"  # the builder's signature is 0.16's


def step_muon(model, root: Path, consumed: int) -> None:
    """root/muon.pt: {"weight": {Megatron key: stacked}} after SGD_STEPS steps of the Muon that
    get_megatron_muon_optimizer builds (fp32, the ADAM and MUON keys, the word embedding at its
    decoupled LR) on the mock samples from `consumed` on: what the sgd command does with SGD."""
    if not available():
        return
    muon = load_muon()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests.megatron_adam import ADAM, BATCH, SGD_STEPS, mock_batch, stacked_state, step

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = muon.get_megatron_muon_optimizer(OptimizerConfig(optimizer="muon", min_lr=0.0, **ADAM, **MUON), [ddp])
    for k in range(SGD_STEPS):
        step(ddp, optimizer, mock_batch(consumed + k * BATCH))
    torch.save(stacked_state(model, optimizer, slots=()), root / "muon.pt")


def write_muon_params(path: Path) -> None:
    """path: {arch: {"muon": [names], "qkv": [names split by QKV]}}, Megatron's parameter names;
    nothing when emerging-optimizers (the builder's dependency) is not installed, or on another
    megatron-core than 0.16.1."""
    if not available():
        return
    from megatron.core import parallel_state

    from tests.megatron_gpt import LAYERS, build

    found = {}
    for arch, untied in MUON_ARCHS:
        model = build(dist.get_world_size(), untied, LAYERS, arch)
        found[arch] = muon_params(model)
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        path.write_text(json.dumps(found, indent=1))


def muon_params(model) -> dict[str, list[str]]:
    """{"muon": [names], "qkv": [those split by QKV], "experts": {name: matrices}}: what
    get_megatron_muon_optimizer gives Muon on `model` (its TensorParallelMuon optimizers, the
    experts' one included), Megatron's parameter names; each SequentialMLP expert's weight is a
    matrix of its own, counted under its torch_dist name (local_experts.<i>. -> experts.)."""
    muon = load_muon()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests.megatron_adam import patch_for_optimizer

    patch_for_optimizer()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    chained = muon.get_megatron_muon_optimizer(OptimizerConfig(lr=1e-3, min_lr=0.0), [ddp])
    names = {id(p): name.removeprefix("module.") for name, p in ddp.named_parameters()}
    muons = [o.optimizer for o in chained.chained_optimizers if isinstance(o.optimizer, muon.TensorParallelMuon)]
    given = [p for o in muons for group in o.param_groups for p in group["params"]]
    experts: dict[str, int] = {}
    for p in given:
        if getattr(p, "expert_tp", False):
            stacked = re.sub(r"\.local_experts\.\d+\.", ".experts.", names[id(p)])
            experts[stacked] = experts.get(stacked, 0) + 1
    return {"muon": sorted(re.sub(r"\.local_experts\.\d+\.", ".experts.", names[id(p)]) for p in given),
            "qkv": sorted(names[id(p)] for p in given if getattr(p, "is_qkv", False)), "experts": experts}  # fmt: skip


def write_mla_moe_muon_params(model, path: Path) -> None:
    """path: muon_params of tests/megatron_mla_gpt.py's model (multi-latent attention, SequentialMLP
    experts, a shared expert, a prediction module), where the builder runs (see write_muon_params)."""
    if available():
        found = muon_params(model)
        if dist.get_rank() == 0:
            path.write_text(json.dumps(found, indent=1))
