"""Megatron's training controls: the step batch-size schedule, sample-based training and the two
loss normalisations (the checkpoint controls are tests/test_resume_controls.py).

The step schedule's expected batches are written out from megatron-core's rules (the batch of
the last THRESHOLD:BS entry whose threshold, tokens // seq_length samples, is <= the samples
consumed); tests/megatron_step_schedule.py compares with megatron-core's own calculator where
it exists (megatron-core >= 0.18).
"""

from __future__ import annotations

import pytest
import torch

from dtgpt.api import build_model, init_distributed
from dtgpt.config import ConfigError, load_config, validate_mesh
from dtgpt.config.batch_schedule import BatchSizeSchedule, parse_step_schedule, total_train_samples, train_iterations
from dtgpt.data.batch import IGNORE_INDEX, TokenOptions, build_batch
from dtgpt.optim import LRSchedule
from dtgpt.parallel.model_parts import cross_entropy_sum
from dtgpt.step import local_forward_backward
from tests.megatron_step_schedule import compare_with_megatron
from tests.parity_oracle import assert_same_training
from tests.runs import TINY, Command, Run, launch_commands, read_metrics, result_of, train_runs

BASE = ["--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", "--data.vocab_size=127", "--model.seq_length=32",
        "--training.micro_batch_size=2"]  # fmt: skip
SCHEDULE = ["--training.step_batch_size_schedule=0:4 512:8", "--training.train_samples=64"]
# 512 tokens of 32 are 16 samples: four batches of 4, then batches of 8 up to 64 samples
DONE_WHEN_BATCHES = [4, 4, 4, 4, 8, 8, 8, 8, 8, 8]


def config(*overrides: str):
    return load_config(None, [*BASE, *overrides])


def walk(schedule: BatchSizeSchedule, iterations: int) -> list[int]:
    """The batch of each iteration, one at a time (what the trainer asks)."""
    consumed, batches = 0, []
    for _ in range(iterations):
        batches.append(schedule.global_batch_size(consumed))
        consumed += batches[-1]
    return batches


# -- the step schedule -------------------------------------------------------------------------


def test_step_schedule_batches_and_iterations():
    cfg = config(*SCHEDULE)
    t = cfg.training
    assert t.global_batch_size == 8  # the schedule's last batch
    schedule = BatchSizeSchedule(t, 32)
    assert schedule.steps == [(0, 4), (16, 8)]
    assert [schedule.global_batch_size(c) for c in (0, 15, 16, 17)] == [4, 4, 8, 8]
    assert train_iterations(t, 32) == 10
    assert walk(schedule, 10) == DONE_WHEN_BATCHES
    assert [schedule.consumed_samples(i) for i in range(12)] == [0, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72]
    assert schedule.sizes() == [4, 8] and total_train_samples(t, 32) == 64


def test_step_schedule_last_batch_may_pass_train_samples():
    """Megatron runs until train_samples are consumed: the last batch of 8 passes 62."""
    cfg = config("--training.step_batch_size_schedule=0:4 512:8", "--training.train_samples=62")
    assert train_iterations(cfg.training, 32) == 10 and total_train_samples(cfg.training, 32) == 64


def test_step_schedule_overshoot_skips_an_entry():
    """A batch that jumps past two thresholds lands on the later entry, as a lookup by samples does."""
    cfg = config("--training.step_batch_size_schedule=0:8 160:2 192:4", "--training.train_samples=40",
                 "--training.micro_batch_size=1")  # fmt: skip
    schedule = BatchSizeSchedule(cfg.training, 32)  # thresholds 0, 5 and 6 samples
    assert walk(schedule, 6) == [8, 4, 4, 4, 4, 4] and train_iterations(cfg.training, 32) == 9
    assert schedule.sizes() == [8, 4] and schedule.consumed_samples(3) == 16


def test_step_schedule_format():
    """Megatron's format: K/M/B/T are powers of 1000 in any case, decimals, commas, any order."""
    gpt3 = parse_step_schedule("0:768 250B:1536 500B:3072 750B:6144", 2048)
    assert gpt3 == [(0, 768), (122070312, 1536), (244140625, 3072), (366210937, 6144)]
    assert parse_step_schedule("0:4, 1k:8", 10) == [(0, 4), (100, 8)]  # 1000 tokens, not 1024
    assert parse_step_schedule("0.5M:16 0:4", 100) == [(0, 4), (5000, 16)]
    assert parse_step_schedule("31:4 64:8", 32) == [(0, 4), (2, 8)]  # 31 tokens are 0 samples


@pytest.mark.parametrize(
    "schedule, rule",
    [
        ("10", 'entry "10" must look like THRESHOLD:BS'),
        (" ", "has no THRESHOLD:BS entry"),
        ("32:4 512:8", "the first threshold must be 0 tokens"),
        ("0:4 16:8", "thresholds must strictly increase in samples"),
        ("0:4 512:0", "every batch size must be > 0"),
        ("0:4 5X:8", '"5X:8" is not THRESHOLD:BS with numbers'),
    ],
)
def test_bad_step_schedule_is_one_error_naming_it(schedule, rule):
    with pytest.raises(ConfigError) as e:
        config(f"--training.step_batch_size_schedule={schedule}", "--training.train_samples=64")
    assert "training.step_batch_size_schedule" in str(e.value) and rule in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (["--training.step_batch_size_schedule=0:4 512:8"], "needs sample-based training: set training.train_samples"),
        ([*SCHEDULE, "--training.rampup_batch_size=[4, 4, 16]"], "training.rampup_batch_size=[4, 4, 16] cannot both be set"),
        ([*SCHEDULE, "--training.global_batch_size=16"], "training.step_batch_size_schedule='0:4 512:8' and training.global_batch_size=16 cannot both be set"),
    ],
)
def test_step_schedule_rules(overrides, rule):
    with pytest.raises(ConfigError, match=rule.replace("[", r"\[").replace("]", r"\]")):
        config(*overrides)


def test_a_command_line_schedule_replaces_the_files_global_batch(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[training]\nglobal_batch_size = 16\n")
    cfg = load_config(path, [*BASE, *SCHEDULE])
    assert cfg.training.global_batch_size == 8


def test_every_schedule_batch_must_split_over_the_ranks():
    cfg = config(*SCHEDULE, "--training.micro_batch_size=4")
    validate_mesh(cfg, 1)
    with pytest.raises(ConfigError, match=r"training.step_batch_size_schedule batch 1=4 must be divisible by micro_batch_size=4 \* data-parallel size 2"):
        validate_mesh(cfg, 2)


@pytest.mark.parametrize(
    "schedule, seq_length, micro, dp",
    [("0:4 512:8", 32, 2, 1), ("0:4 512:8", 32, 1, 4), ("0:768 250B:1536 500B:3072 750B:6144", 2048, 1, 64)],
)
def test_step_schedule_follows_megatron_calculator(schedule, seq_length, micro, dp):
    cfg = load_config(None, [*BASE, f"--model.seq_length={seq_length}", f"--model.max_position_embeddings={seq_length}",
                             f"--training.micro_batch_size={micro}", f"--training.step_batch_size_schedule={schedule}",
                             "--training.train_samples=1000000000"])  # fmt: skip
    edges = [threshold for threshold, _ in BatchSizeSchedule(cfg.training, seq_length).steps]
    consumed = sorted({max(0, e + d) for e in edges for d in range(-3, 4)})
    assert compare_with_megatron(cfg, dp, consumed) == len(consumed)


# -- sample-based training ---------------------------------------------------------------------


def test_train_samples_with_a_constant_batch():
    """train_iters = train_samples // global_batch_size; the LR decays over train_samples."""
    cfg = config("--training.train_samples=100", "--optimizer.lr_warmup_samples=10")
    assert train_iterations(cfg.training, 32) == 12
    schedule = LRSchedule(cfg)
    assert (schedule.decay_steps, schedule.warmup_steps) == (100, 10)
    cfg = config("--training.train_samples=100", "--optimizer.lr_warmup_fraction=0.1", "--optimizer.lr_decay_samples=80")
    assert (LRSchedule(cfg).decay_steps, LRSchedule(cfg).warmup_steps) == (80, 8)


def test_train_samples_with_a_rampup():
    """Megatron's count: iterations while consumed <= ramp samples (batches 4 until 32 samples,
    then 8 at 32: 9 iterations to 40 samples), then whole final batches: (100 - 40) // 8 = 7."""
    cfg = config("--training.train_samples=100", "--training.rampup_batch_size=[4, 4, 32]")
    assert train_iterations(cfg.training, 32) == 16


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (["--training.train_iters=5"], "training.train_iters=5 and training.train_samples=64 cannot both be set"),
        (["--optimizer.lr_decay_iters=5"], "optimizer.lr_decay_iters=5 counts iterations: under training.train_samples use optimizer.lr_decay_samples"),
        (["--optimizer.lr_warmup_iters=2"], "optimizer.lr_warmup_iters=2 counts iterations"),
        (["--optimizer.lr_decay_style=WSD", "--optimizer.lr_wsd_decay_iters=2"], "optimizer.lr_wsd_decay_iters=2 counts iterations"),
    ],
)
def test_sample_based_training_refuses_iteration_keys(overrides, rule):
    with pytest.raises(ConfigError, match=rule):
        config("--training.train_samples=64", *overrides)


@pytest.mark.parametrize("samples, rule", [(0, "must be > 0"), (7, "less than one global batch")])
def test_train_samples_must_give_an_iteration(samples, rule):
    with pytest.raises(ConfigError, match=f"training.train_samples={samples} .*{rule}"):
        config(f"--training.train_samples={samples}")


def test_command_line_train_samples_replaces_the_files_train_iters(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[training]\ntrain_iters = 300\n")
    cfg = load_config(path, [*BASE, "--training.train_samples=64"])
    assert cfg.training.train_iters == 100 and train_iterations(cfg.training, 32) == 8  # the default, unused


# -- runs --------------------------------------------------------------------------------------

RUN = [*TINY, "--training.micro_batch_size=2", "--logging.log_interval=1",
       # the command line, in Megatron's own flags
       "--step-batch-size-schedule", "0:4 512:8", "--train-samples", "64", "--seq-length", "32"]  # fmt: skip
RUN.remove("--training.train_iters=10")
RUN.remove("--optimizer.lr_warmup_iters=2")
RUN.remove("--training.global_batch_size=8")


@pytest.mark.slow
def test_step_schedule_run_logs_its_batches_and_resumes_mid_schedule(tmp_path):
    """train.py with the schedule logs batches 4 then 8 (megatron-core's calculator gives the same:
    test_step_schedule_follows_megatron_calculator), and a run stopped at iteration 3 resumes
    with the same batches, samples and losses."""
    whole, first, second, ckpt = tmp_path / "whole.jsonl", tmp_path / "first.jsonl", tmp_path / "second.jsonl", tmp_path / "ckpt"
    finished = launch_commands([  # one launch, in this order
        Command("whole", tmp_path, [*RUN, f"--logging.metrics_file={whole}"]),
        Command("first", tmp_path, [*RUN, f"--logging.metrics_file={first}", f"--checkpoint.save={ckpt}", "--checkpoint.exit_interval=3"]),
        Command("second", tmp_path, [*RUN, f"--logging.metrics_file={second}", f"--checkpoint.load={ckpt}"]),
    ])  # fmt: skip
    output = finished["whole"].checked()
    records = read_metrics(whole)
    assert [r["global_batch_size"] for r in records] == DONE_WHEN_BATCHES
    assert [r["consumed_samples"] for r in records] == [4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    logged = [line.split("global batch size:")[1].split("|")[0].strip() for line in output.splitlines() if "global batch size:" in line]
    assert logged == [str(b) for b in DONE_WHEN_BATCHES]

    finished["first"].checked(), finished["second"].checked()
    resumed = read_metrics(first) + read_metrics(second)
    for key in ("iteration", "global_batch_size", "consumed_samples"):
        assert [r[key] for r in resumed] == [r[key] for r in records], key
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records], rel=1e-6)


# -- the loss: per token, or the mean of the micro-batch means ---------------------------------


def test_per_micro_batch_mean_is_megatrons_default_loss():
    """calculate_per_token_loss=false: the mean over micro-batches of each one's per-token mean;
    true: every token loss over every loss token. With eod_mask_loss the counts differ, so do they."""
    cfg = load_config(None, [*TINY, "--training.micro_batch_size=2", "--data.vocab_size=16"])
    model = build_model(cfg, init_distributed(cfg), 16)
    samples = torch.randint(0, 15, (8, 33), generator=torch.Generator().manual_seed(0))
    samples[0:2, ::3] = 15  # the first micro-batch holds many eods, the others few
    samples[4, 5] = 15
    batch = build_batch(samples, TokenOptions(eod=15, eod_mask_loss=True))
    assert (batch.labels == IGNORE_INDEX).any()
    with torch.no_grad():
        sums, counts = [], []
        for micro in batch.chunk(4):
            sums.append(cross_entropy_sum(model.parts[0](micro.tokens), micro.labels))
            counts.append((micro.labels != IGNORE_INDEX).sum())
    sums, counts = torch.stack(sums), torch.stack(counts).float()
    mean_of_means = local_forward_backward(model, batch, 4, forward_only=True, per_token=False)
    per_token = local_forward_backward(model, batch, 4, forward_only=True, per_token=True)
    assert mean_of_means.item() == pytest.approx((sums / counts).mean().item(), rel=1e-6)
    assert per_token.item() == pytest.approx((sums.sum() / counts.sum()).item(), rel=1e-6)
    assert abs(mean_of_means.item() - per_token.item()) > 1e-3


MEANS = ["--training.calculate_per_token_loss=false", "--data.eod_mask_loss=true", "--model.position_embedding_type=rope",
         "--training.train_iters=4", "--optimizer.lr_decay_iters=4", "--training.micro_batch_size=2"]  # fmt: skip
MEANS_LAYOUTS = {
    "dp_shard2": ["--parallel.data_parallel_shard_size=2"],
    "cp2": ["--parallel.context_parallel_size=2"],
    "pp2_1f1b": ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B"],
    "pp2_interleaved": ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=Interleaved1F1B",
                        "--parallel.virtual_pipeline_stages_per_rank=2"],  # fmt: skip
}


@pytest.mark.slow
def test_per_micro_batch_mean_trains_the_same_model_in_every_layout(tmp_path_factory):
    """The mean of micro-batch means is layout-invariant for a given micro_batch_size: dp and
    pipelines keep the micro-batches, and under cp each micro-batch's count is summed over the
    cp ranks (Megatron divides each cp rank's chunk by its own count, which differs)."""
    runs = [Run("single", tmp_path_factory.mktemp("single"), MEANS, save_interval=4)]
    runs += [Run(name, tmp_path_factory.mktemp(name), MEANS + extra, 2, save_interval=4) for name, extra in MEANS_LAYOUTS.items()]
    runs.append(Run("per_token", tmp_path_factory.mktemp("per_token"), [*MEANS, "--training.calculate_per_token_loss=true"]))
    results = train_runs(runs)
    want = result_of(results, "single")
    for name in MEANS_LAYOUTS:
        assert_same_training(result_of(results, name), want, 4)
    # one layout, the other setting: a few eods (vocabulary 128, an eod every 128 tokens) shift it a little
    assert result_of(results, "per_token")["loss"] != want["loss"]
