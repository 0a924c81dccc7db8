"""The layout planner's command line: GPT-3 175B's numbers, warnings and refusals, train.py's
--dry-run, and the plan package itself. Its formulas: tests/test_plan_formulas.py; its ranks
against a real CPU run: test_plan_ranks.py; the launch scripts that plan first: test_plan_launch.py.

`make test-fast` keeps the 175B plan (scripts/plan.py, no GPU); the launches of train.py and the
slower plans are marked slow (`make test`)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from dtgpt.config import ConfigError, load_config
from dtgpt.plan import memory as pm
from dtgpt.plan import plan_layout
from dtgpt.plan.activations import ActivationShape, embedding_activation_bytes, layer_activation_bytes
from tests.plans import ENV, GPT3_175B, REPO, SMALL, run_plan

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
