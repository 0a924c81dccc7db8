"""The planner on mixture-of-experts layouts: Mixtral 8x7B as Megatron-LM's example lays it out,
the closed forms against the built model, expert state per rank, and bad MoE configs refused.

The all-to-all formula itself is counted on real gloo ranks in tests/test_comm_counts.py, the
MoE activation terms measured in tests/test_activation_memory.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import dtgpt
from dtgpt.config import load_config
from dtgpt.model import GPT
from dtgpt.model_size import flops_per_token, layer_flops_per_token, num_parameters, router_flops_per_token
from dtgpt.plan import memory as pm
from dtgpt.plan import plan_layout
from tests.plans import ENV, REPO

MIXTRAL = str(REPO / "configs" / "mixtral_8x7b.toml")


@pytest.fixture(scope="module")
def mixtral():
    """Megatron's layout (pp 4 x ep 8, bf16) at the planner's default world size, with flash attention."""
    cfg = load_config(MIXTRAL, check=False)
    return cfg, plan_layout(cfg, fused_attention=True)


def test_mixtral_8x7b_is_planned_on_32_gpus_with_its_published_size(mixtral):
    """Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Mistral AI's figures); pp 4 x ep 8
    needs dp_shard 8 to fold ep out of: 32 GPUs, 4 nodes of the script's 8."""
    cfg, plan = mixtral
    assert plan.world_size == 32 and (plan.mesh["pp"], plan.mesh["dp_shard"], plan.mesh["ep"], plan.mesh["efsdp"]) == (4, 8, 8, 1)
    assert round(plan.total_params / 1e9, 1) == 46.7 and round(plan.active_params / 1e9, 1) == 12.9
    assert plan.total_params == num_parameters(cfg.model, plan.padded_vocab_size)  # built = closed form
    assert not any("planner bug" in w for w in plan.warnings)
    assert plan.fits  # 80 GiB with flash attention, no recomputation, as Megatron runs it


def test_mixtral_experts_stay_whole_per_rank_and_the_rest_is_sharded(mixtral):
    """Each rank holds one whole expert per layer of its stage (ep 8 of 8 experts, efsdp 1) and
    1/8 of everything else (FSDP over dp_shard 8)."""
    cfg, plan = mixtral
    m = cfg.model
    expert = 3 * m.hidden_size * m.ffn_hidden_size  # SwiGLU: gate, fc1, fc2
    middle = plan.ranks[1]
    per_layer = num_parameters(dataclasses.replace(m, num_layers=1), 0) - m.hidden_size  # less the final norm
    others = per_layer - m.num_experts * expert
    assert middle.local_params == 8 * (expert + others // 8)


def test_mixtral_all_to_all_bytes_are_the_routed_rows(mixtral):
    """Per rank and iteration: 8 MoE layers x 32 micro-batches x 4 exchanges (dispatch and combine,
    forward and backward) of b·s·k rows of h bf16 values, plus one count exchange of E int64 each."""
    cfg, plan = mixtral
    m, t = cfg.model, cfg.training
    rows = t.micro_batch_size * m.seq_length * m.moe_router_topk
    layers, micro = m.num_layers // 4, plan.microbatches
    assert plan.all_to_all_bytes == [layers * micro * (4 * rows * m.hidden_size * 2 + 8 * m.num_experts)] * 4


def test_plan_script_plans_mixtral():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plan.py"), "--config", MIXTRAL, "--fused-attention"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "46,702,792,704 parameters (12,879,925,248 active per token)" in proc.stdout
    assert "32 GPUs = pp 4 x dp_replicate 1 x dp_shard 8" in proc.stdout and "all-to-all each rank sends" in proc.stdout


DATA = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=64)
TINY = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, swiglu=True, num_experts=4,
            moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=2, moe_shared_expert_intermediate_size=40)  # fmt: skip


@pytest.mark.parametrize("bias", [False, True])
def test_closed_forms_count_the_built_model(bias):
    """Total parameters are the built GPT's (MoE every other block, a shared expert, router biases);
    active ones drop (E - k) experts per MoE layer."""
    cfg = dtgpt.make_config(model={**TINY, "add_bias_linear": bias}, data=DATA).model
    with torch.device("meta"):
        built = sum(p.numel() for p in GPT(cfg, 64).parameters())
    assert num_parameters(cfg, 64) == built
    expert = 3 * 32 * 48 + (2 * 48 + 32 if bias else 0)
    assert num_parameters(cfg, 64) - num_parameters(cfg, 64, active=True) == 2 * (4 - 2) * expert


def test_one_expert_of_the_dense_width_costs_the_dense_flops_and_the_router_apart():
    """Megatron's count (flops_per_token) is the dense one; the routers' 6·h·E per MoE layer is
    the planner's hardware extra."""
    dense = dtgpt.make_config(model=dict(TINY, num_experts=None, moe_shared_expert_intermediate_size=None), data=DATA).model
    one = dataclasses.replace(dense, num_experts=1, moe_router_topk=1, moe_ffn_hidden_size=None)
    assert layer_flops_per_token(one, moe=True) == layer_flops_per_token(dense)
    assert flops_per_token(one, 64) == flops_per_token(dense, 64)
    moe_blocks = 2  # blocks 0 and 2 of 4 at moe_layer_freq 2
    assert router_flops_per_token(one) == 6 * dense.hidden_size * moe_blocks and router_flops_per_token(dense) == 0


def test_expert_state_is_sharded_over_ep_then_the_remaining_ranks():
    """ep 2 on dp_shard 8 (fp32): the experts split over ep 2, then FSDP over the 4 ranks left;
    everything else over all 8 (8 experts: every FSDP chunk is even)."""
    cfg = dtgpt.make_config(
        model=dict(TINY, num_experts=8, moe_layer_freq=1, moe_shared_expert_intermediate_size=None, hidden_dropout=0.0, attention_dropout=0.0),
        data=DATA,
        training=dict(micro_batch_size=1, global_batch_size=8),
        parallel=dict(expert_model_parallel_size=2),
    )  # fmt: skip
    plan = plan_layout(cfg, 8)
    experts = 4 * 8 * 3 * 32 * 48  # 4 layers of 8 experts
    others = plan.total_params - experts
    rank = plan.ranks[0]
    assert plan.mesh["efsdp"] == 4 and rank.local_params == others // 8 + experts // 2 // 4
    assert rank.memory["params"] * pm.GIB == 4 * rank.local_params


@pytest.mark.parametrize(
    "override,message",
    [
        ("--model.num_experts=6", "expert_model_parallel_size=8 must divide model.num_experts=6"),
        ("--model.moe_router_topk=9", "model.moe_router_topk=9 must be in [1, model.num_experts=8]"),
        ("--world-size=16", "expert_model_parallel_size=8 must divide data_parallel_shard_size=4"),
        ("--model.moe_layer_freq=0", "model.moe_layer_freq=0 must be >= 1"),
        ("--model.num_experts=abc", "model.num_experts='abc' must be an int"),
    ],
)
def test_bad_moe_configs_get_one_error_line(override, message):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plan.py"), "--config", MIXTRAL, override],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("note:")]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines


def test_the_shared_expert_gate_is_counted_with_the_router():
    """A gated shared expert's MoE block: FSDP's gathers count its real parameters, the gate's row
    among them, and the parameter count is the built model's."""
    from dataclasses import replace

    from dtgpt.chunks import padded_numel
    from dtgpt.plan.comm import CommLayout, block_shapes

    cfg = dtgpt.make_config(model={**TINY, "moe_shared_expert_gate": True}, data=DATA)
    with torch.device("meta"):
        model = GPT(cfg.model, 64)
    block = model.layers["0"]
    assert block.mlp.shared_expert_gate is not None
    c = CommLayout.from_config(cfg, 1, 64)
    assert padded_numel(block_shapes(c, moe=True), 1) == sum(p.numel() for p in block.parameters())
    assert num_parameters(cfg.model, 64) == sum(p.numel() for p in model.parameters())
    ungated = CommLayout.from_config(replace(cfg, model=replace(cfg.model, moe_shared_expert_gate=False)), 1, 64)
    assert padded_numel(block_shapes(c, moe=True), 1) - padded_numel(block_shapes(ungated, moe=True), 1) == 32
