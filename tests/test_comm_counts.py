"""The collectives of one training iteration, counted on real gloo ranks, equal the formula.

Two torchrun launches (2 and 4 ranks) each build several layouts (Muon's optimizer step too) in
turn through the library API (tests/comm_counts.py); every rank's counts and message bytes per
collective kind must equal dtgpt.plan.comm's, for 1 and 2 micro-batches per rank (pipelines: 2
and 4, a schedule needs at least pp; two counts tell a collective per iteration from one per
micro-batch). Gradients and all-gathers are once per iteration: FSDP's counts do not grow with
the micro-batches. An all-to-all's message is what a rank sends: its count is the formula's on
every rank, its bytes depend on the routing, so their sum over the ranks is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dataclasses import replace

import pytest

from dtgpt.config import load_config, padded_vocabulary
from dtgpt.data.tokenizer import build_tokenizer
from dtgpt.plan.comm import CommLayout, rank_collectives, totals
from tests.comm_counts import MODEL, layout_config
from tests.runs import REPO

pytestmark = pytest.mark.slow

LAUNCHES = {
    2: ["dp2", "dp2_zero3", "tp2", "tp2_sp", "pp2_1f1b", "pp2_interleaved", "cp2",
        "dp2_bf16", "dp2_bf16r", "tp2_sp_bf16", "pp2_1f1b_bf16", "cp2_bf16", "dp2_fp16", "tp2_sp_fp32", "pp2_1f1b_fp32", "llama_tp2",
        "mqa_tp2", "moe_ep2", "moe_ep2_full", "moe_tp2_sp", "mla_tp2_sp", "mla_cp2", "mtp_dp2", "mtp_cp2", "mtp_pp2_1f1b",
        "mtp_tp2", "mtp_tp2_sp", "mtp_moe_ep2", "mtp_moe_tp2_sp", "muon_mla_tp2_sp",
        "tp2_sp_full", "drop_tp2_full2", "mla_tp2_sp_up_mlp_ln", "moe_ep2_moe_act", "shared_tp2_sp_moe_act"],
    4: ["hsdp2x2", "dp2_tp2", "dp2_tp2_sp", "pp2_dp2", "pp2_tp2", "pp2_tp2_sp", "cp2_tp2_sp", "pp2_tp2_sp_bf16",
        "llama_cp2_tp2_sp", "moe_ep2", "moe_pp2_ep2", "moe_ep2_tp2_sp", "moe_dp2_tp2_sp",
        "mtp_pp2_tp2_sp", "mtp_moe_dp2_tp2_sp", "muon_dp2", "muon_shared_ep2_tp2_sp", "muon_moe_ep2"],
}  # fmt: skip
# Megatron's regime (issue: half the bytes on every link): in these, every collective of at least
# LARGE elements moves the compute dtype, except FSDP's gradient reductions (fp32 by design).
LOW_PRECISION = ["dp2_bf16", "tp2_sp_bf16", "pp2_1f1b_bf16", "cp2_bf16", "pp2_tp2_sp_bf16"]


@pytest.fixture(scope="module", params=sorted(LAUNCHES))
def counted(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """(world size, per-rank counts) of one launch."""
    world = request.param
    out = tmp_path_factory.mktemp(f"comm{world}") / "counts.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(REPO / "tests" / "comm_counts.py"), ",".join(LAUNCHES[world]), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return world, [json.loads((out.parent / f"counts.json.{r}").read_text()) for r in range(world)]


def expected(name: str, world: int, rank: int, micro: int) -> dict[str, list[int]]:
    cfg = layout_config(name, world, micro)
    layout = CommLayout.from_config(cfg, world, padded_vocabulary(cfg, 100))
    pp_rank = rank // (world // layout.pp)
    return totals(rank_collectives(layout, pp_rank, micro, shard_rank=rank // layout.tp % layout.shard))


def test_counts_equal_the_formula(counted):
    world, ranks = counted
    for name in LAUNCHES[world]:
        for micro in ranks[0]["counts"][name]:
            sent = formula = 0
            for rank, counts in enumerate(ranks):
                measured, want = dict(counts["counts"][name][micro]), expected(name, world, rank, int(micro))
                a2a, a2a_want = measured.pop("all_to_all", [0, 0]), want.pop("all_to_all", [0, 0])
                assert measured == want and a2a[0] == a2a_want[0], (name, rank, micro)
                sent, formula = sent + a2a[1], formula + a2a_want[1]
            assert sent == formula, (name, micro)


def test_experts_exchange_tokens_and_shard_over_the_remaining_ranks(counted):
    """ep2: every MoE layer's tokens cross ranks (dispatch, combine, both gradients), and at dp 4 the
    experts' own FSDP unit over the 2 ranks left is one more all-gather per layer than at dp 2."""
    world, ranks = counted
    a2a = ranks[0]["counts"]["moe_ep2"]["1"]["all_to_all"]
    assert a2a[0] == 5 * MODEL["num_layers"] and a2a[1] > 0
    gathers = ranks[0]["counts"]["moe_ep2"]["1"]["all_gather"][0]
    assert gathers == MODEL["num_layers"] + 1 + (MODEL["num_layers"] if world == 4 else 0)
    if world == 2:  # full recomputation, selective 'moe': 1 count and 2 token exchanges more per layer
        for name in ("moe_ep2_full", "moe_ep2_moe_act"):
            assert ranks[0]["counts"][name]["1"]["all_to_all"][0] == a2a[0] + 3 * MODEL["num_layers"]


def test_full_recomputation_replays_the_blocks_tp_collectives(counted):
    """tp2 + SP, every block its own recomputed group: each block gathers its two sub-layers' inputs
    again, and reduce-scatters its attention's output again; its MLP's output feeds nothing backward
    keeps, so the replay stops before that reduce-scatter."""
    world, ranks = counted
    if world != 2:
        pytest.skip("tp2_sp_full runs in the 2-rank launch")
    plain, full = ranks[0]["counts"]["tp2_sp"]["1"], ranks[0]["counts"]["tp2_sp_full"]["1"]
    layers = MODEL["num_layers"]
    assert full["all_gather"][0] == plain["all_gather"][0] + 2 * layers
    assert full["reduce_scatter"][0] == plain["reduce_scatter"][0] + layers


def test_tp_sums_router_and_expert_grads_in_one_bucket(counted):
    """MoE under tp: the router's and experts' gradients (each tp rank's a partial sum) are summed
    over tp in one collective per MoE layer, not one per parameter. dp2 x tp2 + SP: each MoE layer
    is one FSDP unit over all 4 ranks (tp folded in, as Megatron's expert-data-parallel group):
    one reduce-scatter more per layer than the blocks' and the root's, and the all-reduces over
    tp are the norms', the loss's and the router's counts only (the formula names each). tp2
    alone (no FSDP): every pending tp sum of the iteration, norms' included, in one all-reduce."""
    world, ranks = counted
    layers = MODEL["num_layers"]
    if world == 4:
        for name in ("moe_dp2_tp2_sp", "moe_ep2_tp2_sp"):
            measured = ranks[0]["counts"][name]["1"]
            rs = layers + 1 + layers * (2 if name == "moe_ep2_tp2_sp" else 1)  # blocks, root, MoE units (ep: experts' too)
            # + SP's 2 per attention (an MoE layer has none around it) and the head's, over tp
            assert measured["reduce_scatter"][0] == rs + 2 * layers + 1
            grads_over_tp = [c for c in rank_collectives(_layout(name, 4), 0, 1) if c.dim == "tp" and c.kind == "all_reduce" and "grads" in c.what]
            assert [c.what for c in grads_over_tp] == ["sp norm weight grads"], grads_over_tp
    else:
        layout = _layout("moe_tp2_sp", 2)
        bucket = [c for c in rank_collectives(layout, 0, 1) if c.dim == "tp" and "grad" in c.what and c.kind == "all_reduce"]
        assert [(c.what, c.count) for c in bucket] == [("pending tp grad sums, one bucket", 1)]
        measured, want = ranks[0]["counts"]["moe_tp2_sp"]["1"], totals(rank_collectives(layout, 0, 1))
        assert measured["all_reduce"] == want["all_reduce"]


def test_muon_moves_each_matrix_once(counted):
    """--optimizer muon under FSDP (dp 4, GPT with its learned position embedding; ep2 x tp2 + SP,
    the MoE with a shared expert: Llama's attention and SwiGLU's [gate; fc1] matrices sharded over
    dp2 x tp2, as dp2 x tp2 + SP shards a dense Llama's; the MoE at dp 4 x ep2): the optimizer step
    adds 2 all_to_alls (the rows to their owner and back) and at most 1 all-gather of the dense
    matrices (the owner's over tp), not one collective per matrix; under ep 2 all_to_alls more
    for every expert's rows (each expert's matrix has an owner among the ranks FSDP splits its
    rows over: efsdp 2, or efsdp 1 x tp 2), and where tp folds in 1 all-gather per MoE layer of
    its router whole; the bytes are the formula's (test_counts_equal_the_formula)."""
    world, ranks = counted
    if world != 4:
        pytest.skip("the Muon layouts under FSDP run in the 4-rank launch")
    layers = MODEL["num_layers"]
    for name, all_to_alls, gathers in (("muon_shared_ep2_tp2_sp", 4, 1 + layers), ("muon_dp2", 2, 0), ("muon_moe_ep2", 4, 0)):
        adam = totals(rank_collectives(replace(_layout(name, 4), muon=False), 0, 1))
        exchanges = adam.get("all_to_all", [0, 0])[0]  # the MoE layers' tokens
        for counts in ranks:
            measured = counts["counts"][name]["1"]
            assert measured["all_to_all"][0] == exchanges + all_to_alls and measured["all_gather"][0] == adam["all_gather"][0] + gathers, (name, measured)


def _layout(name: str, world: int) -> CommLayout:
    cfg = layout_config(name, world, 1)
    return CommLayout.from_config(cfg, world, padded_vocabulary(cfg, 100))


def test_fsdp_gradients_and_gathers_once_per_iteration(counted):
    """The issue's table: the same FSDP all-gathers and reduce-scatters for 1 and 2 micro-batches."""
    world, ranks = counted
    name = "dp2" if world == 2 else "hsdp2x2"
    few, many = (ranks[0]["counts"][name][m] for m in ("1", "2"))
    assert few["all_gather"] == many["all_gather"] and few["reduce_scatter"] == many["reduce_scatter"]
    assert few["all_gather"][0] == MODEL["num_layers"] + 1  # a unit per block + the root unit


def test_low_precision_moves_no_large_fp32_but_gradients(counted):
    """bf16 on dp2, tp2 + SP, pp2, cp2 and pp2 x tp2 + SP: no fp32 collective of 1,024 elements
    or more but FSDP's gradient reduce-scatters (the census reads each message's dtype)."""
    world, ranks = counted
    for name in (n for n in LOW_PRECISION if n in LAUNCHES[world]):
        for rank, counts in enumerate(ranks):
            for micro, large in counts["large_fp32"][name].items():
                assert large == [], (name, rank, micro, large)


def test_grad_reduce_in_bf16_halves_the_gradient_bytes(counted):
    """training.grad_reduce_in_bf16 (Megatron's --grad-reduce-in-bf16): FSDP's reduce-scatters carry
    the same elements as under bf16 alone, in bf16 (2 bytes each, not 4); the gathers are unchanged."""
    world, ranks = counted
    if world != 2:
        pytest.skip("dp2_bf16r runs in the 2-rank launch")
    for counts in ranks:
        for micro in ("1", "2"):
            fp32, bf16 = counts["counts"]["dp2_bf16"][micro], counts["counts"]["dp2_bf16r"][micro]
            assert bf16["reduce_scatter"][0] == fp32["reduce_scatter"][0] and 2 * bf16["reduce_scatter"][1] == fp32["reduce_scatter"][1]
            assert bf16["all_gather"] == fp32["all_gather"]


def test_the_census_sees_fp32_activations(counted):
    """The census can fail: the same wide model in fp32 shows its SP activations (functional
    collectives) and its pipeline sends (the p2p record) among the large fp32 collectives."""
    world, ranks = counted
    if world == 2:
        ops = {op for r in ranks for name in ("tp2_sp_fp32", "pp2_1f1b_fp32") for large in r["large_fp32"][name].values() for op, _ in large}
        assert {"_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor", "c10d::send", "c10d::recv_"} <= ops


def test_twin_counts_equal_the_formula(tmp_path):
    """The 175B twin (fp16, pp2 x dp_shard2 x tp2 with SP, 8 micro-batches) on 8 ranks: the
    formula the planner prints for configs/gpt3_175b.toml holds there rank by rank."""
    twin = REPO / "configs" / "gpt3_175b_twin.toml"
    out = tmp_path / "counts.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
           str(REPO / "tests" / "comm_counts.py"), "twin", "--config", str(twin), "--out", str(out),
           f"--data.data_cache_path={tmp_path}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    cfg = load_config(str(twin), [])
    layout = CommLayout.from_config(cfg, 8, padded_vocabulary(cfg, build_tokenizer(cfg.data).vocab_size))
    for rank in range(8):
        measured = json.loads((tmp_path / f"counts.json.{rank}").read_text())["counts"]["twin"]
        assert measured == {"8": totals(rank_collectives(layout, rank // 4, 8))}, rank
