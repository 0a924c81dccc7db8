"""dtgpt.plan.comm without ranks: the 175B figures by hand, ring traffic, and the planner's lines.

The formula itself is checked against real collectives in tests/test_comm_counts.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dtgpt.chunks import padded_numel
from dtgpt.config import load_config
from dtgpt.model import GPT
from dtgpt.plan import plan_layout
from dtgpt.plan.comm import Collective, CommLayout, block_shapes, rank_collectives, totals
from dtgpt.plan.links import link_bytes, rank_traffic
from dtgpt.plan.report import format_plan
from tests.runs import REPO, load_script

GPT3_175B = str(REPO / "configs" / "gpt3_175b.toml")


def layout_175b(world_size: int = 128) -> CommLayout:
    return CommLayout.from_config(load_config(GPT3_175B, []), world_size, 51200)


def test_175b_middle_rank_by_hand():
    """pp rank 8 of tp 8 x pp 16 (dp 1), SP, fp16, 1536 micro-batches of 1 x 2048 tokens."""
    c = layout_175b()
    n, act = 1536, 2048 * 12288 * 2  # every activation in fp16 (the model computes in it)
    got = totals(rank_collectives(c, 8, n))
    # 6 blocks, 2 sub-layers: fwd all-gathers of norm outputs, bwd ones of matmul-output grads
    assert got["all_gather"] == [4 * 6 * n, 4 * 6 * n * act]
    assert got["reduce_scatter"] == got["all_gather"]
    # 24 norm tensors' gradients (h fp16 each) in one bucket (dp 1: a compute copy, no FSDP to
    # sum each alone); the loss and the squared gradient norm
    assert got["all_reduce"] == [1 + 1, 24 * 12288 * 2 + 2 * 4]
    sp_act = 2048 // 8 * 12288 * 2  # the sequence shard of the residual stream (fp16) crosses stages
    assert got["send"] == got["recv"] == [2 * n, 2 * n * sp_act]
    traffic = rank_traffic(c, 8, n, nvlink_gbps=300, ib_gbps=25)
    nvlink = 7 / 8 * (2 * 4 * 6 * n * act) + 2 * 7 / 8 * (24 * 12288 * 2)
    assert traffic.nvlink_bytes == nvlink
    assert abs(traffic.seconds - (nvlink / 300e9 + (traffic.sent_bytes - nvlink) / 25e9)) < 1e-9


def test_fsdp_once_per_iteration_unless_resharding_always():
    c = layout_175b(world_size=1024)  # dp_shard 8
    once = [totals(rank_collectives(c, 0, n))["all_gather"][0] - 4 * 6 * n - n for n in (16, 192)]
    assert once[0] == once[1] == 6 + 1  # 6 blocks and the embedding unit, whatever n
    zero3 = replace(c, pp=1, layer_counts=(96,), reshard_every_micro_batch=True, sequence_parallel=False)
    gathers = [col.count for col in rank_collectives(zero3, 0, 4) if col.kind == "all_gather"]
    assert gathers == [8] * 96 + [4]  # blocks forward and backward, the root unit once


def test_ring_traffic():
    ar = Collective("all_reduce", "tp", "x", 2, 100)
    assert link_bytes(ar, 8) == 2 * 100 * 2 * 7 / 8
    assert link_bytes(Collective("all_gather", "tp", "x", 1, 100), 4) == 75
    assert link_bytes(Collective("send", "pp", "x", 3, 100), 2) == 300
    assert link_bytes(ar, 1) == 0


def test_planner_prints_communication():
    cfg = load_config(str(REPO / "configs" / "debug_3d.toml"), [])
    plan = plan_layout(cfg, 8)
    assert len(plan.comm) == plan.mesh["pp"] and plan.est_comm_s == max(t.seconds for t in plan.comm)
    text = format_plan(cfg, plan)
    assert "comm       pp rank 0: sends and receives" in text and "not overlapped with compute" in text


def test_no_class_of_collective_moves_more_than_megatron():
    """scripts/comm_vs_megatron.py: per pp rank and collective class, the bytes a dtgpt rank sends
    per iteration are at most Megatron-LM's for the 175B layout (tp8 x pp16) and its twin
    (dp2 x tp2 x pp2); with SP the blocks' tp traffic is 4/5 of it (Megatron all-gathers each
    column-parallel input again in backward, dtgpt keeps the gathered one)."""
    script = load_script("comm_vs_megatron")
    for config, world in (("gpt3_175b.toml", 128), ("gpt3_175b_twin.toml", 8)):
        rows = script.compare(load_config(str(REPO / "configs" / config), []), world)
        assert all(ours <= theirs for _, _, ours, theirs in rows), [r for r in rows if r[2] > r[3]]
        tp = [ours / theirs for _, name, ours, theirs in rows if name == "tp activations"]
        assert all(0.75 < ratio < 0.85 for ratio in tp), tp


def test_the_family_gathers_its_own_parameters():
    """FSDP's gathers count a block's real parameters, whatever the family member: the Llama 3 8B
    config's blocks (grouped QKV, SwiGLU, no biases) and a qk-layernorm model's, against the model."""
    qk_norm = ["--model.qk_layernorm=true", "--model.add_qkv_bias=true", "--model.add_bias_linear=false", "--model.kv_channels=48"]
    for path, overrides in (("llama3_8b.toml", []), ("debug.toml", qk_norm)):
        cfg = load_config(str(REPO / "configs" / path), overrides)
        with torch.device("meta"):
            block = GPT(replace(cfg.model, num_layers=1), 128).layers["0"]
        c = CommLayout.from_config(cfg, 1, 128)
        assert padded_numel(block_shapes(c), 1) == sum(p.numel() for p in block.parameters()), path


def test_mixtral_moves_no_more_than_megatron_but_in_scalars():
    """Mixtral 8x7B (pp 4 x ep 8 on 32 GPUs): the experts' all-to-all moves what Megatron's
    alltoall dispatcher moves (its per-expert counts are an all-gather, ours an all-to-all of
    1/ep of it), and every other class at most Megatron's, but for the scalars: in bf16 with pp
    and dp, dtgpt's one all-reduce of loss and norm over the world sends a few bytes more than
    Megatron's norm over the world plus loss over dp (dense layouts alike, not MoE's)."""
    script = load_script("comm_vs_megatron")
    rows = script.compare(load_config(str(REPO / "configs" / "mixtral_8x7b.toml"), [], check=False), 32)
    a2a = [(ours, theirs) for _, name, ours, theirs in rows if name == "ep all-to-all"]
    assert len(a2a) == 4 and all(0.99 < ours / theirs <= 1 for ours, theirs in a2a), a2a
    assert all(ours <= theirs for _, name, ours, theirs in rows if name != "scalars"), rows


def test_muon_moves_no_more_than_megatron_but_in_scalars():
    """--optimizer muon on the twin (dp2 x tp2 x pp2) and the 175B layout at 1024 GPUs (dp 8), bf16
    (Megatron's Muon refuses fp16): against Megatron's dist_muon (plain DDP's all-reduce, the
    layer-wise all-gather, every tp rank gathering every matrix), dtgpt's reduce-scatter plus its
    two all_to_alls of the matrices' rows move less than the all-reduce, and its busiest owner
    gathers over tp at most 1/dp of the matrices plus one (dtgpt/muon_owners.py); the scalars as
    in the Mixtral test."""
    script = load_script("comm_vs_megatron")
    muon = ["--optimizer.optimizer=muon", "--training.fp16=false", "--training.bf16=true"]
    for config, world, dp in (("gpt3_175b_twin.toml", 8, 2), ("gpt3_175b.toml", 1024, 8)):
        rows = script.compare(load_config(str(REPO / "configs" / config), muon, check=False), world)
        assert all(ours <= theirs for _, name, ours, theirs in rows if name != "scalars"), [r for r in rows if r[2] > r[3]]
        tp = [(ours, theirs) for _, name, ours, theirs in rows if name == "tp muon gathers" and theirs]
        assert tp and all(ours <= theirs / dp * 1.2 for ours, theirs in tp), tp


def test_the_plan_counts_muons_step_beyond_the_activations():
    """The twin (bf16, short sequences) planned with Muon: every rank's muon_step term is at least what Newton-Schulz
    holds for the largest matrix (fc1, 4h x h whole in fp32, four times), less the activations that
    backward freed before the step; Adam's plan has no such term."""
    bf16 = ["--training.fp16=false", "--training.bf16=true", "--model.seq_length=8", "--training.micro_batch_size=1"]
    twin = str(REPO / "configs" / "gpt3_175b_twin.toml")
    adam, muon = (plan_layout(load_config(twin, bf16 + extra, check=False), 8) for extra in ([], ["--optimizer.optimizer=muon"]))
    h = load_config(twin, []).model.hidden_size
    assert all(r.memory["muon_step"] == 0 for r in adam.ranks)
    for r in muon.ranks:
        nesting = 4 * 4 * (4 * h * h) / 2**30 - r.memory["activations"] - r.memory["pipeline"]
        assert r.memory["muon_step"] >= nesting > 0, r.memory


def test_padded_rows_are_torch_chunks():
    """dtgpt/chunks.py, the one spelling of FSDP's padded rows that Muon's exchange
    (dtgpt/muon_owners.py) and the planner share: each rank's rows are torch.chunk's (as
    DTensor's Shard and FSDP2 split), padded to the first chunk's; none past the last."""
    import torch

    from dtgpt.chunks import chunk_rows, rows_of

    for rows in range(0, 12):
        for ranks in range(1, 6):
            chunks = [c.size(0) for c in torch.arange(rows).chunk(ranks)] if rows else []
            assert [rows_of(rows, ranks, r) for r in range(ranks)] == chunks + [0] * (ranks - len(chunks)), (rows, ranks)
            assert chunk_rows(rows, ranks) == max(chunks, default=0)
            assert padded_numel([(rows, 3)], ranks) == ranks * chunk_rows(rows, ranks) * 3
    assert padded_numel([(4, 5, 7)], 2, dim=1) == 4 * 6 * 7


def test_mixtral_experts_have_owners_under_muon():
    """Mixtral 8x7B with Muon at 256 ranks (pp 4, ep 8, efsdp 8: one expert per ep rank, 8 MoE
    layers a stage): each of the 16 expert matrices of a rank's stage has an owner among the 8
    efsdp ranks (one fc1 and one fc2 each), so a rank sends its rows of all of them, 1/8 of the
    stacks, and its two owned matrices' rows back, no stack whole (docs/schedules.md's figures)."""
    cfg = load_config(str(REPO / "configs" / "mixtral_8x7b.toml"), ["--optimizer.optimizer=muon"], check=False)
    c = CommLayout.from_config(cfg, 256, 32000)
    stacks = 8 * (28672 * 4096 + 4096 * 14336) * 4  # fp32, whole, 8 MoE layers
    for shard_rank in (0, 9, None):
        muon = [col for col in rank_collectives(c, 1, 1, shard_rank) if col.what.startswith("muon")]
        experts = [(col.kind, col.dim, col.count, col.message_bytes) for col in muon if "expert" in col.what]
        assert experts == [("all_to_all", "efsdp", 1, stacks // 8)] * 2, experts


def test_a_misspelled_key_is_one_error_line(capfd):
    """scripts/comm_vs_megatron.py takes config overrides: a key no section has is one `error:`
    line and exit 2, not the loader's traceback."""
    script = load_script("comm_vs_megatron")
    assert script.main(["--config", str(REPO / "configs" / "mixtral_8x7b.toml"), "--training.world_size=8"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: unknown key --training.world_size") and err.count("\n") == 1, err
