"""End-to-end runs of train.py on CPU: the loss falls, logs and metrics, fp16, NaN guard, ramp-up."""

import pytest

from tests.runs import REPO, TINY, read_metrics, run_train, train_losses

pytestmark = pytest.mark.slow  # train.py runs

DESIGN_KEYS = {
    "iteration", "consumed_samples", "loss", "lr", "grad_norm", "loss_scale", "global_batch_size",
    "skipped", "nan", "tokens_per_s", "tflops_per_gpu", "mfu",
}  # fmt: skip


def test_debug_config_loss_falls_and_logs(tmp_path):
    """The `make train` config on the built-in corpus: falling loss, log line, 30 JSON lines."""
    metrics = tmp_path / "m.jsonl"
    proc = run_train(
        tmp_path,
        ["--config", str(REPO / "configs/debug.toml"), "--training.train_iters=30", "--logging.log_interval=10",
         "--eval.eval_interval=15", "--eval.eval_iters=1", f"--logging.metrics_file={metrics}", "--optimizer.lr_warmup_iters=5"],
    )  # fmt: skip
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == list(range(1, 31))
    assert all(set(r) == DESIGN_KEYS for r in records)
    assert records[-1]["consumed_samples"] == 30 * 16
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)
    lines = [l for l in proc.stdout.splitlines() if "iteration " in l and "lm loss:" in l]
    assert len(lines) == 3
    for field in ("consumed samples:", "elapsed time per iteration (ms):", "throughput per GPU (TFLOP/s/GPU):",
                  "learning rate:", "global batch size:", "lm loss:", "grad norm:",
                  "number of skipped iterations:", "number of nan iterations:"):  # fmt: skip
        assert field in lines[-1]
    assert "validation loss at iteration 15" in proc.stdout and "on test set" in proc.stdout


def test_fp16_scaler_skips_then_trains(tmp_path):
    """Starting at 2^32 the first iterations overflow and are skipped; then the loss falls."""
    records_path = tmp_path / "m.jsonl"
    run_train(tmp_path, TINY + ["--training.fp16=true", "--training.train_iters=40", "--training.micro_batch_size=4",
                                f"--logging.metrics_file={records_path}"])  # fmt: skip
    records = read_metrics(records_path)
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


def test_nan_is_skipped(tmp_path):
    losses_path = tmp_path / "m.jsonl"
    run_train(tmp_path, TINY + ["--faults.nan_at_iterations=[3, 4]", f"--logging.metrics_file={losses_path}"])
    records = read_metrics(losses_path)
    assert records[2]["loss"] is None and records[3]["loss"] is None  # written as null
    assert records[-1]["nan"] == 2 and records[-1]["skipped"] == 2
    # the skipped steps did not corrupt the weights: training continues with finite, falling loss
    assert all(r["loss"] is not None for r in records[4:])
    assert records[-1]["loss"] < records[0]["loss"]


def test_nan_stops_with_clear_message(tmp_path):
    proc = run_train(tmp_path, TINY + ["--faults.nan_at_iterations=[3]", "--training.nan_policy=stop"], check=False)
    assert proc.returncode != 0
    assert "non-finite loss" in proc.stderr + proc.stdout and "iteration 3" in proc.stderr + proc.stdout


def test_rampup_pipeline_matches_single_process(tmp_path):
    """Ramp-up changes the micro-batch count (4 -> 8): pp2 rebuilds its schedule and keeps parity."""
    ramp = ["--training.rampup_batch_size=[4, 4, 24]"]
    single = train_losses(tmp_path, ramp, name="single")
    piped = train_losses(tmp_path, ramp + ["--parallel.pipeline_model_parallel_size=2"], nproc=2, name="pp2")
    records = read_metrics(tmp_path / "pp2.jsonl")
    assert [r["global_batch_size"] for r in records[:7]] == [4, 4, 4, 4, 4, 4, 8]
    assert piped == pytest.approx(single, rel=1e-5)
