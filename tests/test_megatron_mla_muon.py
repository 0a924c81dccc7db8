"""Muon on the multi-latent attention + MoE + MTP model: dtgpt's build_optimizer gives Muon the
matrices megatron-core's own builder does (recorded in conftest's mla_root launch)."""

from __future__ import annotations

import json

import pytest
import torch

from dtgpt.checkpoint.megatron.keys import megatron_name
from dtgpt.config import OptimizerConfig
from dtgpt.model import GPT
from dtgpt.muon import MUON, muon_matrices
from dtgpt.optim import build_optimizer
from tests.megatron_mla_gpt import EXPERTS
from tests.megatron_mla_oracle import ROWS, model_cfg


@pytest.mark.slow
def test_dtgpt_gives_muon_the_matrices_megatron_cores_builder_gives_it_on_mla_and_moe(mla_root):
    """megatron-core's get_megatron_muon_optimizer on its MLA + MoE model (tests/megatron_muon.py, in
    this launch) against dtgpt's build_optimizer on the same model: the same matrices take Muon (the
    latent attention's projections, none split as QKV; the router; the shared expert; the
    prediction module's), and each stacked expert weight is as many matrices as megatron-core's
    SequentialMLP has experts."""
    found = mla_root / "muon_params.json"
    if not found.exists():
        pytest.skip("megatron-core's Muon builder needs emerging-optimizers (make setup) and megatron-core 0.16.1")
    megatron = json.loads(found.read_text())
    with torch.device("meta"):
        model = GPT(model_cfg(), ROWS)
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = build_optimizer(model.named_parameters(), OptimizerConfig(optimizer="muon"), matrices=muon_matrices(model))
    muon = [p for g in optimizer.param_groups if g.get(MUON) for p in g["params"]]
    ours = {megatron_name(names[id(p)], mla=True, per_layer=True)[0]: p for p in muon}  # gate and fc1: linear_fc1
    assert sorted(ours) == sorted(set(megatron["muon"])) and megatron["qkv"] == []
    assert {name: ours[name].shape[0] for name in ours if ours[name].ndim == 3} == megatron["experts"]
    assert set(megatron["experts"].values()) == {EXPERTS} and "decoder.layers.1.mlp.router.weight" in ours
    assert "decoder.layers.1.self_attention.linear_kv_down_proj.weight" in ours

