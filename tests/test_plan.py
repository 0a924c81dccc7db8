"""The layout planner: GPT-3 175B numbers, formulas, warnings, and a real CPU run as the oracle.

`make test-fast` keeps the 175B plan (scripts/plan.py, no GPU) and the formulas; the launches of
train.py and the scripts, the real CPU run and the slower plans are marked slow (`make test`)."""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dtgpt.config import ConfigError, interleaved_round_size, load_config
from dtgpt.plan import memory as pm
from dtgpt.plan import plan_layout, tokenizer_vocab_size
from dtgpt.plan.activations import ActivationShape, embedding_activation_bytes, layer_activation_bytes, layer_activation_terms
from tests.test_data_tokenizer import write_hf_tokenizer

REPO = Path(__file__).resolve().parent.parent
GPT3_175B = str(REPO / "configs" / "gpt3_175b.toml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# A small layout where every rank differs: uneven pipeline stages, two virtual stages per rank,
# FSDP chunks of unequal size (129 vocabulary rows and 20 positions over dp 2), a tied head.
SMALL = [
    "--model.num_layers=5",
    "--model.hidden_size=24",
    "--model.num_attention_heads=2",
    "--model.seq_length=16",
    "--model.max_position_embeddings=20",
    "--model.make_vocab_size_divisible_by=2",
    "--training.micro_batch_size=1",
    "--training.global_batch_size=8",
    "--parallel.tensor_model_parallel_size=2",
    "--parallel.pipeline_model_parallel_size=2",
    "--parallel.data_parallel_shard_size=2",
    "--parallel.pipeline_schedule=Interleaved1F1B",
    "--parallel.virtual_pipeline_stages_per_rank=2",
    "--parallel.pipeline_layers_per_stage=[2,1,1,1]",
    "--parallel.sequence_parallel=true",
    "--data.builtin_corpus=python-docstrings",
    "--data.tokenizer_type=ByteTokenizer",
]


def run_plan(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / "plan.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def plan_175b() -> tuple[dict, float]:
    """The CLI's JSON plan of configs/gpt3_175b.toml (128 GPUs), and the CPU seconds it took
    (user + system: what the planner costs, which a loaded machine does not stretch as it does
    the wall clock)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = run_plan("--config", GPT3_175B, "--json")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout), cpu_s


def test_planning_175b_allocates_no_parameter_memory(plan_175b):
    # One 175B stage alone would take 1.46e9 x 4 B = 5.4 GiB; every child process so far
    # (this fixture's planner included) peaked far below that.
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak_kib < 3 * 2**20


def test_175b_parameters_per_rank(plan_175b):
    plan, _ = plan_175b
    assert plan["world_size"] == 128 and plan["padded_vocab_size"] == 51200
    assert plan["total_params"] == 174_615_846_912
    ranks = plan["ranks"]
    assert len(ranks) == 128 and {(r["pp_rank"], r["tp_rank"]) for r in ranks} == {(p, t) for p in range(16) for t in range(8)}
    by_pp = {}
    for r in ranks:
        by_pp.setdefault(r["pp_rank"], set()).add(r["local_params"])
    assert all(len(v) == 1 for v in by_pp.values()), "every tp rank of a stage holds the same count"
    assert by_pp[0] == {1_463_270_400}
    assert all(by_pp[p] == {1_359_461_376} for p in range(1, 15))  # 6 layers x 226,576,896
    assert by_pp[15] == {1_438_129_152}  # the last stage's own copy of the tied weight included
    assert all(r["layers"] == 6 for r in ranks)
    assert ranks[-1]["layer_ids"] == list(range(90, 96))


def test_175b_schedule_and_time(plan_175b):
    plan, _ = plan_175b
    assert plan["microbatches"] == 1536 and plan["microbatches_initial"] == 16
    assert plan["bubble_fraction"] == pytest.approx(15 / (1536 + 15))
    assert plan["tokens_per_iteration"] == 1536 * 2048
    assert plan["flops_per_iteration"] == pytest.approx(plan["flops_per_token"] * 1536 * 2048)
    # No recomputation in this config: hardware FLOPs = model FLOPs; 128 GPUs at 140 TFLOP/s.
    assert plan["est_iteration_s"] == pytest.approx(plan["flops_per_iteration"] / (128 * 140e12))
    assert plan["est_days"] == pytest.approx(300e9 * plan["flops_per_token"] / (128 * 140e12) / 86400)
    # 1F1B: the first stage keeps pp micro-batches in flight, the last one.
    first = next(r for r in plan["ranks"] if r["pp_rank"] == 0)
    last = next(r for r in plan["ranks"] if r["pp_rank"] == 15)
    assert (first["in_flight"], last["in_flight"]) == (16, 1)
    # fp16 with dropout, Korthikanti's unfused attention core, dtgpt's SP (gathered inputs kept)
    shape = ActivationShape(2048, 1, 12288, 96, 51200, 8, True, ffn_size=4 * 12288, megatron_sp=False)
    assert shape == ActivationShape.for_config(load_config(GPT3_175B), 51200, 8)
    per_layer = layer_activation_bytes(shape, recompute="none")
    expected = (16 * (6 * per_layer + embedding_activation_bytes(shape))) / pm.GIB
    assert first["memory"]["activations"] == pytest.approx(expected)
    # fp16, FSDP of one rank: the fp32 master and its gradient, Adam m, v, the fp16 gathered copy
    # and the fp16 gradient accumulated over micro-batches (Megatron's default for fp16): 20 B.
    assert first["memory"]["params"] + first["memory"]["copies"] + first["memory"]["grads"] + first["memory"]["adam"] == pytest.approx(
        (4 + 4 + 8 + 2 + 2) * first["local_params"] / pm.GIB
    )
    assert plan["fits"] and all(r["memory_gib"] < 80 for r in plan["ranks"])


def test_175b_stage_memory_counts_the_pipeline_receive_buffers(plan_175b):
    """Each stage holds one received activation and one received gradient (the first stage only
    the gradient, the last only the activation) of b·s/tp·h fp16 under SP, whatever the 1,536
    micro-batches (tests/test_pipeline_buffers.py measures the count on gloo ranks)."""
    plan, _ = plan_175b
    boundary = 1 * 2048 // 8 * 12288 * 2  # 6.3 MB
    for r in plan["ranks"]:
        buffers = 1 if r["pp_rank"] in (0, 15) else 2
        assert r["memory"]["pipeline"] == pytest.approx(buffers * boundary / pm.GIB)
        assert r["memory_gib"] == pytest.approx(sum(v for k, v in r["memory"].items() if k != "total"))


def test_175b_warns_about_the_rampup_bubble(plan_175b):
    plan, _ = plan_175b
    assert any("ramp-up" in w and "16 micro-batches" in w and "48%" in w for w in plan["warnings"]), plan["warnings"]


def test_cli_finishes_in_seconds(plan_175b):
    _, cpu_s = plan_175b
    assert cpu_s < 60  # about 5 s of CPU; its wall time under CI's load can be ten times that


@pytest.mark.slow
def test_175b_compiled_passes_validation_and_plans():
    """configs/gpt3_175b.toml with training.compile=true (tp 8 x pp 16 with SP, 1F1B, dropout 0.1
    on Megatron's streams) is a layout tests/test_compile.py covers (compiled dropout under tp draws
    eager's masks), so validation allows it and the planner builds its ranks."""
    plan = plan_layout(load_config(GPT3_175B, ["--training.compile=true"]), 128)
    assert plan.mesh["tp"] == 8 and plan.mesh["pp"] == 16 and plan.fits


def test_classic_time_formula():
    # Narayanan et al. 2021: 300B tokens of 175B on 1024 GPUs at 140 TFLOP/s -> ~34 days.
    days = pm.classic_training_days(300e9, 175e9, 1024, 140)
    assert days == pytest.approx(33.9, abs=0.1)
    assert pm.classic_training_days(300e9, 175e9, 1024, 140, recompute=False) == pytest.approx(days * 6 / 8)


@pytest.mark.slow
def test_175b_on_1024_gpus_with_full_recomputation_takes_about_34_days():
    cfg = load_config(GPT3_175B, ["--training.recompute_granularity=full", "--training.recompute_method=uniform", "--training.recompute_num_layers=1"])
    plan = plan_layout(cfg, 1024)
    assert plan.mesh["dp_shard"] == 8
    # FSDP divides every rank's parameters by dp = 8.
    assert {r.local_params for r in plan.ranks if r.pp_rank == 0} == {1_463_270_400 // 8}
    # Recomputing all 96 layers adds one forward: 4/3 of the layer FLOPs.
    layer = 12 * 12288**2 * (2 + 2048 / 12288 + 4)  # 12h^2 (QKV + out: 2, scores: s/h, MLP: f/h)
    assert plan.hardware_flops_per_token == pytest.approx(plan.flops_per_token + 96 * layer / 3)
    assert plan.est_days == pytest.approx(34, abs=1.0)
    assert plan.est_days == pytest.approx(
        pm.classic_training_days(300e9, plan.total_params, 1024, 140), rel=0.05
    )
    # Ramp-up starts at 16 samples = 2 micro-batches per dp rank for 16 stages: they run, as in
    # Megatron (dtgpt.parallel.schedules), and the warning says so and what it costs.
    ramp = next(w for w in plan.warnings if "ramp-up" in w)
    assert "2 micro-batches on 16 stages, 1F1B's warm-up capped at 2, as in Megatron" in ramp and "88%" in ramp
    assert not any("fewer than" in w for w in plan.warnings)


def test_activation_formulas():
    """Korthikanti's 34·s·b·h + 5·a·s²·b per layer, /t with SP; selective drops the a·s²·b term
    (the terms measured on the model: tests/test_activation_memory.py)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    base = dict(seq_length=s, micro_batch_size=b, hidden_size=h, num_heads=a, padded_vocab=51200)
    none, sp, tp_only = (ActivationShape(**base, tp=n, sequence_parallel=q) for n, q in ((1, False), (t, True), (t, False)))
    assert layer_activation_bytes(none, "none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert layer_activation_bytes(sp, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert layer_activation_bytes(tp_only, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer_activation_bytes(none, "selective") == pytest.approx(sbh * 34)
    assert layer_activation_bytes(sp, "selective") == pytest.approx(sbh / t * 34)
    assert layer_activation_bytes(tp_only, "selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(sp, "full") == pytest.approx(2 * sbh / t)
    assert layer_activation_bytes(tp_only, "full") == pytest.approx(2 * sbh)
    # Which terms apply: a dropout of p = 0 keeps no mask (nor, for attention, a dropped copy);
    # a fused kernel keeps no scores; dtgpt's SP keeps the gathered QKV and fc1 inputs (not /t).
    quiet = ActivationShape(**base, tp=1, sequence_parallel=False, hidden_dropout=False, attention_dropout=False)
    assert layer_activation_bytes(quiet, "none") == pytest.approx(sbh * (32 + 2 * a * s / h))
    flash = ActivationShape(**base, tp=1, sequence_parallel=False, scores_kept=False)
    assert layer_activation_terms(flash, "none") == layer_activation_terms(none, "selective")
    dtgpt_sp = ActivationShape(**base, tp=t, sequence_parallel=True, megatron_sp=False)
    assert layer_activation_bytes(dtgpt_sp, "selective") == pytest.approx(sbh * (30 / t + 4))
    # fp32 doubles every activation but the 1-byte dropout masks; fp32_residual_connection the norm inputs
    fp32 = ActivationShape(**base, tp=1, sequence_parallel=False, compute_bytes=4)
    assert layer_activation_bytes(fp32, "none") == pytest.approx(sbh * (66 + (4 + 1 + 4) * a * s / h))
    fp32_residual = ActivationShape(**base, tp=1, sequence_parallel=False, residual_bytes=4)
    assert layer_activation_bytes(fp32_residual, "selective") == pytest.approx(sbh * 38)
    assert layer_activation_bytes(fp32_residual, "full") == pytest.approx(4 * sbh)


def test_schedule_formulas():
    assert [pm.chunks_in_flight("1F1B", 4, r, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert pm.chunks_in_flight("1F1B", 4, 0, 1, 2) == 2  # never more than the micro-batches
    assert pm.chunks_in_flight("GPipe", 4, 3, 1, 8) == 8
    # Interleaved: Korthikanti's first stage keeps pp·(1 + (pp-1)/(pp·v)) micro-batches of L/pp layers.
    pp, v = 4, 2
    chunks = pm.chunks_in_flight("Interleaved1F1B", pp, 0, v, 64)
    assert chunks / v == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
    assert pm.bubble_fraction("1F1B", 4, 1, 8) == pytest.approx(3 / 11)
    assert pm.bubble_fraction("GPipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert pm.bubble_fraction("Interleaved1F1B", 4, 2, 8) == pytest.approx(3 / 19)
    assert pm.bubble_fraction("1F1B", 1, 1, 8) == 0.0


def test_interleaved_in_flight_is_megatrons_warm_up_with_rounds_that_divide_the_count():
    """megatron-core's warm-up count (get_pp_rank_microbatches) with its
    microbatch_group_size_per_vp_stage set to the round size dtgpt runs, plus the steady chunk."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    pp, v = 4, 2
    for m in (2, 8, 10, 13, 14, 16):
        group = interleaved_round_size(m, pp)
        for r in range(pp):
            comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda r=r: r), virtual_pipeline_model_parallel_size=v)
            total, _, warmup, _ = get_pp_rank_microbatches(m, v, group, p2p_communicator=comm)
            assert pm.chunks_in_flight("Interleaved1F1B", pp, r, v, m) == min(warmup + 1, total), (m, r)


def test_plan_peaks_over_the_ramp_up_under_interleaving():
    """pp 4 x 2 virtual stages, batches 8, 10, 12, 14, 16: 14 runs in rounds of 7, so pp rank 0
    keeps more chunks in flight than at the final 16, and the plan says so."""
    ramp = ["--model.num_layers=8", "--model.hidden_size=24", "--model.num_attention_heads=2", "--model.seq_length=16",
            "--training.micro_batch_size=1", "--training.global_batch_size=16", "--training.rampup_batch_size=[8,2,40]",
            "--parallel.pipeline_model_parallel_size=4", "--parallel.virtual_pipeline_stages_per_rank=2",
            "--parallel.pipeline_schedule=Interleaved1F1B", "--data.mock_data=true"]  # fmt: skip
    plan = plan_layout(load_config(None, ramp), 4)
    first = next(r for r in plan.ranks if r.pp_rank == 0)
    assert first.in_flight == pm.chunks_in_flight("Interleaved1F1B", 4, 0, 2, 14) > pm.chunks_in_flight("Interleaved1F1B", 4, 0, 2, 16)
    assert any("14 micro-batches in rounds of 7" in note for note in plan.notes), plan.notes


def test_state_bytes():
    """fp32 at dp 1 (no FSDP); bf16 (FSDP at every dp: 2-byte gathered copies, fp32 gradients)."""
    fp32 = pm.state_bytes(1000, 1000, 100, compute_bytes=4, grad_bytes=4, fsdp=False, pipelined=True, reshard_after_forward=False)
    assert (fp32.params, fp32.copies, fp32.grads, fp32.adam) == (4000, 0, 4000, 8000)
    kw = dict(compute_bytes=2, grad_bytes=4, fsdp=True, pipelined=True, reshard_after_forward=False)
    one_rank = pm.state_bytes(1000, 1000, 100, **kw)  # a bf16 run on one rank per stage
    assert (one_rank.params, one_rank.copies, one_rank.grads, one_rank.adam) == (4000, 2000, 4000 + 4000, 8000)
    # FSDP over dp = 4 under pp: gathered bf16 params and fp32 unsharded gradients stay until the
    # last micro-batch.
    piped = pm.state_bytes(250, 1000, 100, **kw)
    assert (piped.params, piped.copies, piped.grads, piped.adam) == (1000, 2000, 1000 + 4000, 2000)
    # Without pp, resharding after forward: about two gathered units and one unit's gradients
    # (bf16 from backward, the fp32 buffer they are reduce-scattered from).
    alone = pm.state_bytes(250, 1000, 100, **{**kw, "pipelined": False, "reshard_after_forward": True})
    assert (alone.copies, alone.grads) == (2 * 2 * 100, 1000 + (2 + 4) * 100)
    fp16 = pm.state_bytes(250, 1000, 100, **{**kw, "grad_bytes": 2})  # fp16 reduced in fp16
    assert fp16.grads == 1000 + 2000


def test_sgd_state_is_its_momentum():
    """--optimizer sgd keeps one fp32 momentum buffer per parameter (none at momentum 0), not Adam's two."""
    base = ["--data.mock_data=true", "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4"]
    adam, sgd, plain = (plan_layout(load_config(None, base + extra), 2).ranks[0]
                        for extra in ([], ["--optimizer", "sgd"], ["--optimizer", "sgd", "--sgd-momentum", "0"]))  # fmt: skip
    assert adam.local_params > 0
    assert [r.memory["adam"] * pm.GIB for r in (adam, sgd, plain)] == pytest.approx([8 * adam.local_params, 4 * adam.local_params, 0])


def test_muon_state_is_one_momentum_for_its_matrices_and_adams_for_the_rest():
    """--optimizer muon: 4 bytes per element of a matrix Muon steps (every 2-D weight but the word
    embedding and the head: 12 h^2 per block and the position embedding), 8 for the rest."""
    base = ["--data.mock_data=true", "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4"]
    cfg = load_config(None, base)
    adam, muon = (plan_layout(load_config(None, base + extra), 2).ranks[0] for extra in ([], ["--optimizer", "muon"]))
    matrices = (2 * 12 * 32 * 32 + cfg.model.seq_length * 32) // 2  # positions: seq_length rows; FSDP: half on each rank
    assert muon.local_params == adam.local_params > 2 * matrices
    assert muon.memory["adam"] * pm.GIB == pytest.approx(4 * matrices + 8 * (adam.local_params - matrices))


@pytest.mark.slow
def test_planner_counts_match_a_real_cpu_run(tmp_path):
    """The oracle: 8 ranks build the real model (tests/plan_real_counts.py) on CPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
           str(REPO / "tests" / "plan_real_counts.py"), *SMALL, f"--data.data_cache_path={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    plan = plan_layout(load_config(None, SMALL), 8, dp_ranks=(0, 1))
    planned = {r.rank: (r.pp_rank, r.dp_rank, r.tp_rank, r.local_params) for r in plan.ranks}
    measured = {r["rank"]: (r["pp_rank"], r["dp_rank"], r["tp_rank"], r["local_params"]) for r in real}
    assert planned == measured
    # The layout is uneven on purpose: the check would miss nothing by comparing equal numbers.
    assert len({v[3] for v in measured.values()}) >= 4


def test_deduplicated_builds_equal_building_every_rank():
    cfg = load_config(None, SMALL + ["--parallel.pipeline_model_parallel_size=4", "--parallel.data_parallel_shard_size=1",
                                     "--parallel.pipeline_schedule=1F1B", "--parallel.virtual_pipeline_stages_per_rank=1",
                                     "--parallel.pipeline_layers_per_stage=[]", "--model.num_layers=8"])  # fmt: skip
    fast, full = plan_layout(cfg, 8), plan_layout(cfg, 8, all_ranks=True)
    assert fast.builds < full.builds == 8
    key = lambda p: [(r.rank, r.layer_ids, r.local_params, r.memory) for r in p.ranks]  # noqa: E731
    assert key(fast) == key(full)


def test_block_recomputation_follows_the_real_blocks():
    args = ["--training.recompute_granularity=full", "--training.recompute_method=block", "--training.recompute_num_layers=1"]
    plan = plan_layout(load_config(None, SMALL + args), 8)
    # 'block' recomputes the first block of each of the 4 stages ([2, 1, 1, 1] blocks): 4 of 5.
    by_pp = {r.pp_rank: r.recomputed_layers for r in plan.ranks}
    assert sum(by_pp.values()) == 4
    selective = plan_layout(load_config(None, SMALL + ["--training.recompute_granularity=selective"]), 8)
    plain = plan_layout(load_config(None, SMALL), 8)
    assert all(r.recomputed_layers == 0 for r in selective.ranks)
    for r, q in zip(selective.ranks, plain.ranks):
        assert 0 < r.memory["activations"] < q.memory["activations"]
    # A fused attention kernel keeps no scores: what selective recomputation drops.
    fused = plan_layout(load_config(None, SMALL), 8, fused_attention=True)
    assert [r.memory["activations"] for r in fused.ranks] == pytest.approx([r.memory["activations"] for r in selective.ranks])


@pytest.mark.slow
def test_impossible_layouts_are_refused_with_the_rule():
    proc = run_plan("--config", GPT3_175B, "--parallel.tensor_model_parallel_size=5")
    assert proc.returncode == 2
    assert "impossible layout" in proc.stdout and "tensor_model_parallel_size=5 must divide model.num_attention_heads=96" in proc.stdout
    proc = run_plan("--config", GPT3_175B, "--parallel.pipeline_model_parallel_size=7", "--json")
    assert proc.returncode == 2
    out = json.loads(proc.stdout)
    assert out["possible"] is False and "model.num_layers=96 must be divisible" in out["errors"][0]
    with pytest.raises(ConfigError, match="world size 100"):
        plan_layout(load_config(GPT3_175B), 100)
    with pytest.raises(ConfigError, match="padded vocabulary 258"):
        plan_layout(load_config(None, SMALL + ["--parallel.tensor_model_parallel_size=4", "--parallel.pipeline_model_parallel_size=1",
                                               "--parallel.pipeline_schedule=1F1B", "--parallel.virtual_pipeline_stages_per_rank=1",
                                               "--parallel.pipeline_layers_per_stage=[]", "--model.num_attention_heads=4"]), 8)  # fmt: skip


@pytest.mark.slow
def test_over_memory_names_the_dominant_term_and_check_fails(tmp_path):
    args = ["--config", str(REPO / "configs" / "debug_3d.toml"), "--training.micro_batch_size=8", "--training.global_batch_size=64", "--gpu-memory-gib=0.02"]
    proc = run_plan(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # without --check the plan is only printed
    assert "OVER" in proc.stdout
    warning = next(line for line in proc.stdout.splitlines() if line.startswith("WARNING") and "exceed" in line)
    assert "activations" in warning and "recompute_granularity='full'" in warning
    assert run_plan(*args, "--check").returncode == 1
    assert run_plan("--config", str(REPO / "configs" / "debug_3d.toml"), "--check").returncode == 0


@pytest.mark.slow
def test_model_state_dominates_a_large_model_on_few_gpus():
    cfg = load_config(GPT3_175B, ["--parallel.pipeline_model_parallel_size=4", "--training.recompute_granularity=full", "--training.recompute_method=uniform", "--training.recompute_num_layers=1"])
    plan = plan_layout(cfg, 32)
    warning = next(w for w in plan.warnings if "exceed" in w)
    assert "adam" in warning and "data_parallel_shard_size" in warning
    assert not plan.fits


@pytest.mark.slow
def test_train_py_dry_run_prints_the_plan():
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "debug_3d.toml"), "--dry-run"]
    # debug_3d takes data_parallel_shard_size from the world size: 8 ranks, as torchrun would say
    proc = subprocess.run(cmd, cwd=REPO, env={**ENV, "WORLD_SIZE": "8"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 GPUs = pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2" in proc.stdout
    assert "local params" in proc.stdout


def test_vocabulary_follows_the_tokenizer(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(300)}))
    gpt2 = load_config(GPT3_175B, [f"--data.vocab_file={vocab}"])
    assert tokenizer_vocab_size(gpt2) == (300, None)
    size, note = tokenizer_vocab_size(load_config(GPT3_175B, ["--data.vocab_file=missing.json"]))
    assert size == 50257 and "not found" in note
    assert tokenizer_vocab_size(load_config(None, SMALL))[0] == 257
    null = load_config(None, ["--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", "--data.vocab_size=1000"])
    assert tokenizer_vocab_size(null)[0] == 1000
    hf = ["--data.mock_data=true", "--data.tokenizer_type=HuggingFaceTokenizer"]
    tokenizer_dir = write_hf_tokenizer(tmp_path / "hf")
    assert tokenizer_vocab_size(load_config(None, [*hf, f"--data.tokenizer_model={tokenizer_dir}"])) == (321, None)
    size, note = tokenizer_vocab_size(load_config(None, [*hf, "--data.tokenizer_model=missing", "--data.vocab_size=1000"]))
    assert size == 1000 and "data.tokenizer_model='missing': no such directory" in note


# -- launch scripts ------------------------------------------------------------------------------


def _fake_tool(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _run_script(script: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    full = {**ENV, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(REPO / script), *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=300)


PATHS = ["/ckpt", "/tb", "/vocab.json", "/merges.txt", "0.3 /data/a_text_document 0.7 /data/b_text_document"]


@pytest.mark.slow
def test_launch_script_plans_then_runs_torchrun(tmp_path):
    """Megatron's 175B script with train.py: its arrays of Megatron flags, planned first."""
    record = tmp_path / "torchrun.args"
    torchrun = _fake_tool(tmp_path, "torchrun", f'printf "%s\\n" "$@" > {record}')
    proc = _run_script("scripts/train_gpt3_175b_distributed.sh", PATHS, {"TORCHRUN": str(torchrun), "NODE_RANK": "3"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1,463,270,400" in proc.stdout  # the plan was printed first (pp rank 0's parameters, 51,200 vocabulary rows)
    args = record.read_text().splitlines()
    assert args[:10] == ["--nproc_per_node", "8", "--nnodes", "16", "--node_rank", "3", "--master_addr", "localhost",
                         "--master_port", "6000"]  # fmt: skip
    assert args[10] == str(REPO / "train.py")
    train_args = args[11:]
    assert train_args[:12] == ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
                               "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto"]  # fmt: skip
    assert train_args[train_args.index("--rampup-batch-size") :][:4] == ["--rampup-batch-size", "16", "16", "5859375"]
    assert train_args[train_args.index("--data-path") :][:5] == ["--data-path", *PATHS[4].split()]
    assert train_args[-14:] == ["--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
                                "--save", "/ckpt", "--load", "/ckpt", "--eval-iters", "10", "--tensorboard-dir", "/tb"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "env, extra, code",
    [
        ({}, ["--group-query-attention", "--num-query-groups", "5"], 2),  # 5 key/value heads over tp 8
        ({"NUM_NODES": "3"}, [], 2),  # 24 GPUs for pp 16 x tp 8
        ({"GPU_MEMORY_GIB": "40"}, [], 1),
    ],
    ids=["heads", "world-size", "memory"],
)
def test_launch_script_refuses_a_layout_the_planner_rejects(tmp_path, env, extra, code):
    record = tmp_path / "launched"
    torchrun = _fake_tool(tmp_path, "torchrun", f"touch {record}")
    proc = _run_script("scripts/train_gpt3_175b_distributed.sh", PATHS + extra, {"TORCHRUN": str(torchrun), **env})
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "refusing to launch" in proc.stderr and not record.exists()


@pytest.mark.slow
def test_sbatch_plans_then_srun_torchrun_with_c10d_rendezvous(tmp_path):
    _fake_tool(tmp_path, "scontrol", 'printf "gpu-node-017\\ngpu-node-018\\n"')
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "DTGPT_DRY_RUN": "1", "DTGPT_REPO": str(REPO),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-node-[017-018]",
           "GPUS_PER_NODE": "4", "CONFIG": str(REPO / "configs" / "debug_3d.toml")}  # fmt: skip
    proc = _run_script("scripts/slurm/gpt3_175b.sbatch", PATHS, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launch = proc.stdout.strip().splitlines()[-1]
    assert launch.startswith("srun --nodes 2 --ntasks-per-node 1")
    assert "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint gpu-node-017:29500 --rdzv-id 4242" in launch
    assert "--checkpoint.save=/ckpt" in launch
    refused = _run_script("scripts/slurm/gpt3_175b.sbatch", PATHS + ["--parallel.tensor_model_parallel_size=3"], env)
    assert refused.returncode == 2 and "srun" not in refused.stdout


def test_plan_package_imports_run_one_way():
    """dtgpt/plan/ modules import each other without a cycle (report once imported the planner
    that imported it)."""
    import ast

    package = REPO / "dtgpt" / "plan"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    edges = {}
    for name in modules:
        tree = ast.parse((package / f"{name}.py").read_text())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dtgpt.plan"):
                rest = node.module[len("dtgpt.plan"):].lstrip(".")
                targets |= {rest} if rest else {alias.name for alias in node.names}
        edges[name] = targets & modules
    assert edges["results"] == set() and "layout" not in edges["report"]

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in edges[start])

    assert not [m for m in modules if reaches(m, m)]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--tflops", "0"], "argument --tflops: 0 must be a finite number > 0"),  # divided the time by zero
        (["--ib-gbps", "0"], "argument --ib-gbps: 0 must be a finite number > 0"),
        (["--tflops", "nan"], "argument --tflops: nan must be a finite number > 0"),  # printed nan days
        (["--gpu-memory-gib", "-1"], "argument --gpu-memory-gib: -1 must be a finite number > 0"),
        (["--world-size", "0"], "argument --world-size: 0 must be a finite number > 0"),  # planned the default world
        (["--world-size", "2.5"], "argument --world-size: '2.5' is not an int"),
    ],
)
def test_plan_options_out_of_range_are_one_error_line(capsys, argv, says):
    from dtgpt.plan import cli

    with pytest.raises(SystemExit) as e:
        cli(["--mock-data", *argv])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"plan.py: error: {says}"
