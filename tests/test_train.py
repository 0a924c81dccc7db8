"""End-to-end runs of train.py on CPU: the loss falls, logs and metrics, fp16, NaN guard, ramp-up."""

import pytest

from tests.runs import REPO, TINY, Command, launch_commands, read_metrics, run_train, selected_cases

pytestmark = pytest.mark.slow  # train.py runs

DESIGN_KEYS = {
    "iteration", "consumed_samples", "loss", "lr", "grad_norm", "loss_scale", "global_batch_size",
    "skipped", "nan", "tokens_per_s", "tflops_per_gpu", "mfu",
}  # fmt: skip


def debug_commands(directory) -> list[Command]:
    return [Command("debug", directory, [
        "--config", str(REPO / "configs/debug.toml"), "--training.train_iters=30", "--logging.log_interval=10",
        "--eval.eval_interval=15", "--eval.eval_iters=1", f"--logging.metrics_file={directory / 'debug.jsonl'}",
        "--optimizer.lr_warmup_iters=5"])]  # fmt: skip


def fp16_commands(directory) -> list[Command]:
    return [Command("fp16", directory, TINY + ["--training.fp16=true", "--training.train_iters=40", "--training.micro_batch_size=4",
                                               f"--logging.metrics_file={directory / 'fp16.jsonl'}"])]  # fmt: skip


def nan_commands(directory) -> list[Command]:
    return [Command("nan", directory, TINY + ["--faults.nan_at_iterations=[3, 4]", f"--logging.metrics_file={directory / 'nan.jsonl'}"])]


RAMP = ["--training.rampup_batch_size=[4, 4, 24]"]


def rampup_commands(directory) -> list[Command]:
    return [
        Command("ramp_single", directory, TINY + RAMP + [f"--logging.metrics_file={directory / 'ramp_single.jsonl'}"]),
        Command("ramp_pp2", directory, TINY + RAMP + ["--parallel.pipeline_model_parallel_size=2",
                                                      f"--logging.metrics_file={directory / 'ramp_pp2.jsonl'}"], 2),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """The selected tests' runs, launched together: one launch per rank count (tests/runs.py
    launch_commands) instead of one each. {key: (Finished, its directory)}."""
    plans = {
        test_debug_config_loss_falls_and_logs: debug_commands,
        test_fp16_scaler_skips_then_trains: fp16_commands,
        test_nan_is_skipped: nan_commands,
        test_rampup_pipeline_matches_single_process: rampup_commands,
    }
    commands = [c for test, plan in plans.items() if selected_cases(request, test) for c in plan(tmp_path_factory.mktemp(test.__name__))]
    finished = launch_commands(commands) if commands else {}
    return {c.key: (finished[c.key], c.directory) for c in commands}


def records_of(runs: dict, key: str) -> list[dict]:
    """A batched run's metrics records; a run that failed fails the test with its log."""
    finished, directory = runs[key]
    finished.checked()
    return read_metrics(directory / f"{key}.jsonl")


def test_debug_config_loss_falls_and_logs(runs):
    """The `make train` config on the built-in corpus: falling loss, log line, 30 JSON lines."""
    output = runs["debug"][0].checked()
    records = records_of(runs, "debug")
    assert [r["iteration"] for r in records] == list(range(1, 31))
    assert all(set(r) == DESIGN_KEYS for r in records)
    assert records[-1]["consumed_samples"] == 30 * 16
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)
    lines = [l for l in output.splitlines() if "iteration " in l and "lm loss:" in l]
    assert len(lines) == 3
    for field in ("consumed samples:", "elapsed time per iteration (ms):", "throughput per GPU (TFLOP/s/GPU):",
                  "learning rate:", "global batch size:", "lm loss:", "grad norm:",
                  "number of skipped iterations:", "number of nan iterations:"):  # fmt: skip
        assert field in lines[-1]
    assert "validation loss at iteration 15" in output and "on test set" in output


def test_fp16_scaler_skips_then_trains(runs):
    """Starting at 2^32 the first iterations overflow and are skipped; then the loss falls."""
    records = records_of(runs, "fp16")
    assert records[0]["loss_scale"] == 2.0**32 and records[0]["skipped"] == 1
    skipped = records[-1]["skipped"]
    assert 2 <= skipped < 30
    assert records[-1]["loss_scale"] < 2.0**32
    # hysteresis 2: the first overflow keeps the scale, the second halves it
    assert records[1]["loss_scale"] == 2.0**31
    trained = [r for r in records if r["iteration"] > skipped + 1]
    assert trained[-1]["loss"] < trained[0]["loss"]
    # a skipped iteration consumes samples but does not move the LR schedule: the first
    # trained iteration still uses the LR of iteration 1, the one after it has moved on
    # (later overflows may skip a few more once training moves the gradients)
    leading = next(i for i, r in enumerate(records) if r["skipped"] == i)  # the skips before the first step
    assert {r["lr"] for r in records[: leading + 1]} == {records[0]["lr"]}
    assert records[leading + 1]["lr"] != records[0]["lr"]
    assert records[leading]["consumed_samples"] == (leading + 1) * 8


def test_nan_is_skipped(runs):
    records = records_of(runs, "nan")
    assert records[2]["loss"] is None and records[3]["loss"] is None  # written as null
    assert records[-1]["nan"] == 2 and records[-1]["skipped"] == 2
    # the skipped steps did not corrupt the weights: training continues with finite, falling loss
    assert all(r["loss"] is not None for r in records[4:])
    assert records[-1]["loss"] < records[0]["loss"]


def test_nan_stops_with_clear_message(tmp_path):
    proc = run_train(tmp_path, TINY + ["--faults.nan_at_iterations=[3]", "--training.nan_policy=stop"], check=False)
    assert proc.returncode != 0
    assert "non-finite loss" in proc.stderr + proc.stdout and "iteration 3" in proc.stderr + proc.stdout


def test_rampup_pipeline_matches_single_process(runs):
    """Ramp-up changes the micro-batch count (4 -> 8): pp2 rebuilds its schedule and keeps parity."""
    single = [r["loss"] for r in records_of(runs, "ramp_single")]
    records = records_of(runs, "ramp_pp2")
    piped = [r["loss"] for r in records]
    assert [r["global_batch_size"] for r in records[:7]] == [4, 4, 4, 4, 4, 4, 8]
    assert piped == pytest.approx(single, rel=1e-5)
