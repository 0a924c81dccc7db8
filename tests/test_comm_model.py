"""dtgpt.plan.comm without ranks: the 175B figures by hand, ring traffic, and the planner's lines.

The formula itself is checked against real collectives in tests/test_comm_counts.py.
"""

from __future__ import annotations

from dataclasses import replace

from dtgpt.config import load_config
from dtgpt.plan import plan_layout
from dtgpt.plan.comm import Collective, CommLayout, link_bytes, rank_collectives, rank_traffic, totals
from dtgpt.plan.report import format_plan
from tests.runs import REPO

GPT3_175B = str(REPO / "configs" / "gpt3_175b.toml")


def layout_175b(world_size: int = 128) -> CommLayout:
    return CommLayout.from_config(load_config(GPT3_175B, []), world_size, 51200)


def test_175b_middle_rank_by_hand():
    """pp rank 8 of tp 8 x pp 16 (dp 1), SP, fp16, 1536 micro-batches of 1 x 2048 tokens."""
    c = layout_175b()
    n, act, residual = 1536, 2048 * 12288 * 2, 2048 * 12288 * 4  # matmul outputs fp16, norm outputs fp32
    got = totals(rank_collectives(c, 8, n))
    # 6 blocks, 2 sub-layers: fwd all-gathers of norm outputs (fp32), bwd ones of matmul-output grads
    assert got["all_gather"] == [4 * 6 * n, 2 * 6 * n * (act + residual)]
    assert got["reduce_scatter"] == got["all_gather"]
    # 24 norm tensors' gradients (h fp32 each); grad norm over tp (72 tensors), pp, loss, overflow
    assert got["all_reduce"] == [24 + 4, 24 * 12288 * 4 + 72 * 4 + 3 * 4]
    sp_act = 2048 // 8 * 12288 * 4  # the sequence shard of the residual stream (fp32) crosses stages
    assert got["send"] == got["recv"] == [2 * n, 2 * n * sp_act]
    traffic = rank_traffic(c, 8, n, nvlink_gbps=300, ib_gbps=25)
    nvlink = 7 / 8 * (2 * 2 * 6 * n * (act + residual)) + 2 * 7 / 8 * (24 * 12288 * 4)
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
