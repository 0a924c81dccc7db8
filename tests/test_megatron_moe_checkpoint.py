"""Megatron MoE checkpoints in and out, with megatron-core's own MoE GPTModel as the oracle.

One megatron-core launch on 2 gloo ranks at ep 2 (tests/megatron_moe_gpt.py): a 2-layer model of
MoE layers (4 SequentialMLP experts, top-2 of a sigmoid router with the expert bias, a SwiGLU
shared expert) saves torch_dist (the experts on their global axis) and the per-rank format
(mp_rank_00_000 and mp_rank_00_001, each with its 2 local_experts), and records its logits; in
the same launch it loads the checkpoints dtgpt wrote before it (to-megatron torch_dist and
per-rank at ep 2) into a model from another seed and records those logits. dtgpt must give the
same logits both ways.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dtgpt
from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.export import load_model, read_config
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.formats import is_torch_dist, per_rank_dirs, progress_of
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import ModelConfig
from tests.megatron_gpt import ITERATION, VOCAB, tokens
from tests.megatron_moe_gpt import EXPERT_FFN, EXPERTS, SHARED_FFN, TOPK
from tests.test_checkpoint_convert import load_script
from tests.test_megatron_family import ARCHS

ROWS = 112  # 100 padded to a multiple of 16, Megatron's at tp 1
SCRIPT = Path(__file__).with_name("megatron_moe_gpt.py")
MOE = dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=SHARED_FFN)  # fmt: skip
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0, attention_dropout=0.0,
             make_vocab_size_divisible_by=16, **ARCHS["llama"], **MOE)  # fmt: skip


def model_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{**MODEL, **overrides})


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours[..., :VOCAB], theirs[..., :VOCAB]
    return ((ours - theirs).norm() / theirs.norm()).item()


def save_dtgpt(root: Path) -> Path:
    """A dtgpt checkpoint of the MoE model at its seeded init, with router weights, expert biases
    and norms drawn wide (routing then depends on them; a mix-up of any would show)."""
    cfg = dtgpt.make_config(model=MODEL, data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB),
                            training=dict(micro_batch_size=2, global_batch_size=2))  # fmt: skip
    runtime = dtgpt.init_distributed(cfg)
    model = dtgpt.build_model(cfg, runtime, VOCAB)
    draw = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, value in model.parts[0].state_dict(keep_vars=True).items():
            if "router" in name:
                value.copy_(torch.randn(value.shape, generator=draw))
            elif "norm" in name:
                value.uniform_(0.5, 1.5, generator=draw)
    return dtgpt.save_checkpoint(root, cfg, runtime, model, iteration=3)


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory) -> Path:
    """dtgpt's checkpoint and its to-megatron conversion, then megatron-core's launch at ep 2."""
    root = tmp_path_factory.mktemp("megatron_moe")
    save_dtgpt(root / "dtgpt")
    assert load_script().main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT), str(root)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return root


@pytest.mark.slow
def test_megatron_moe_torch_dist_at_ep2_gives_megatrons_logits(moe_root):
    directory = find(moe_root / "megatron")
    assert is_torch_dist(directory)
    reader = MegatronReader(directory)
    # the experts on torch_dist's global expert axis, after the layer axis
    assert reader.shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, EXPERTS, 2 * EXPERT_FFN, 64)
    assert reader.shapes["decoder.layers.mlp.router.expert_bias"] == (2, EXPERTS)
    model = load_megatron_model(directory, model_cfg(), ROWS).eval()
    assert model.layers["0"].mlp.router.expert_bias.abs().min() > 0  # Megatron's drawn bias, not the zero init
    with torch.no_grad():
        assert relative_error(model(tokens()), torch.load(moe_root / "logits.pt", weights_only=True)) < 1e-5


@pytest.mark.slow
def test_megatron_moe_per_rank_files_at_ep2_give_megatrons_logits(moe_root):
    directory = find(moe_root / "megatron_per_rank")
    # Megatron-LM names ep ranks with a lone 3-digit suffix when pp is 1: (tp, pp, ep)
    assert sorted(per_rank_dirs(directory, expert_parallel=True)) == [(0, 0, 0), (0, 0, 1)]
    assert progress_of(MegatronReader(directory).common)["iteration"] == ITERATION
    model = load_megatron_model(directory, model_cfg(), ROWS).eval()
    with torch.no_grad():
        assert relative_error(model(tokens()), torch.load(moe_root / "logits.pt", weights_only=True)) < 1e-5


@pytest.mark.slow
def test_dtgpt_moe_checkpoint_to_megatron_loads_in_megatron_core_at_ep2_with_equal_logits(moe_root, tmp_path):
    saved = layout.iteration_dir(moe_root / "dtgpt", 3)
    model = load_model(saved, read_config(saved)).eval()
    with torch.no_grad():
        ours = model(tokens())
    assert relative_error(ours, torch.load(moe_root / "loaded_logits.pt", weights_only=True)) < 1e-5
    # and back: from-megatron gives every tensor again, the expert bias included
    config = saved / "config.toml"
    assert load_script().main(["from-megatron", str(moe_root / "from_dtgpt"), str(tmp_path / "back"), "--config", str(config)]) == 0
    back = load_model(layout.iteration_dir(tmp_path / "back", 3), read_config(saved))
    for (name, p), q in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.slow
@pytest.mark.parametrize("overrides, key", [
    (dict(moe_router_topk=1), "model.moe_router_topk: the checkpoint has 2 but the config has 1"),
    (dict(num_experts=None, moe_router_enable_expert_bias=False), "model.num_experts: the checkpoint has 4 but the config has unset"),
    (dict(moe_shared_expert_intermediate_size=None), "model.moe_shared_expert_intermediate_size: the checkpoint has 48"),
])  # fmt: skip
def test_a_moe_architecture_other_than_megatrons_args_is_one_error(moe_root, overrides, key):
    for name in ("megatron", "megatron_per_rank"):
        with pytest.raises(CheckpointError, match=key):
            load_megatron_model(find(moe_root / name), model_cfg(**overrides), ROWS)
