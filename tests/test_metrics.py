"""The log line, the JSONL schema, TensorBoard output, MFU and the peak table."""

import json
import math
import re
from datetime import datetime

import pytest
import torch

from dtgpt.config import LoggingConfig
from dtgpt.timers import Timers
from dtgpt.log_format import format_eval_block, format_log_line, summarize_interval
from dtgpt.metrics import (
    DEVICE_PEAK_TFLOPS,
    METRICS_KEYS,
    MetricsLogger,
    last_recorded_iteration,
    lookup_peak_tflops,
    memory_stats,
    peak_tflops,
    throughput_metrics,
)


def _field(line: str, name: str) -> str:
    match = re.search(re.escape(name) + r":\s*([^|]+?)\s*\|", line)
    assert match, f"{name!r} missing from {line!r}"
    return match.group(1)


def _record(it, loss=2.0, skipped=0, nan=0, elapsed_ms=100.0, **extra):
    rec = {
        "iteration": it,
        "consumed_samples": 8 * it,
        "loss": loss,
        "lr": 3e-4,
        "grad_norm": 1.5,
        "loss_scale": 1.0,
        "global_batch_size": 8,
        "skipped": skipped,
        "nan": nan,
        "tokens_per_s": 1000.0,
        "tflops_per_gpu": 2.0,
        "mfu": None,
        "elapsed_ms": elapsed_ms,
    }
    rec.update(extra)
    return rec


def test_format_log_line_has_megatron_fields_in_order():
    line = format_log_line(
        iteration=10, train_iters=100, consumed_samples=80, elapsed_ms=123.4, learning_rate=3e-4,
        global_batch_size=8, loss=4.56789, loss_scale=1.0, grad_norm=1.234, skipped=0, nan=2,
        tflops_per_gpu=1.25, tokens_per_s=5000.0, mfu=0.415,
        memory={"mem_allocated_gib": 1.5, "mem_peak_gib": 2.25}, now=datetime(2026, 11, 22, 18, 0, 0),
    )
    assert line.startswith(" [2026-11-22 18:00:00] iteration       10/     100 | consumed samples:           80 |")
    assert line.endswith(" |")
    assert int(_field(line, "consumed samples")) == 80
    assert float(_field(line, "elapsed time per iteration (ms)")) == pytest.approx(123.4)
    assert float(_field(line, "throughput per GPU (TFLOP/s/GPU)")) == pytest.approx(1.2, abs=0.06)
    assert _field(line, "learning rate") == "3.000000E-04"
    assert int(_field(line, "global batch size")) == 8
    assert _field(line, "lm loss") == "4.567890E+00"
    assert float(_field(line, "loss scale")) == 1.0
    assert float(_field(line, "grad norm")) == pytest.approx(1.234)
    assert int(_field(line, "number of skipped iterations")) == 0
    assert int(_field(line, "number of nan iterations")) == 2
    assert float(_field(line, "tokens per second")) == 5000.0
    assert _field(line, "MFU") == "41.50%"
    assert float(_field(line, "memory allocated (GiB)")) == 1.5
    assert float(_field(line, "memory peak allocated (GiB)")) == 2.25
    assert "memory reserved" not in line
    megatron = ["consumed samples", "elapsed time per iteration", "throughput per GPU", "learning rate",
                "global batch size", "lm loss", "loss scale", "grad norm", "number of skipped",
                "number of nan", "tokens per second", "MFU"]
    positions = [line.index(name) for name in megatron]
    assert positions == sorted(positions)


def test_format_log_line_leaves_out_unknown_fields():
    line = format_log_line(
        iteration=1, train_iters=2, consumed_samples=8, elapsed_ms=1.0, learning_rate=1e-3,
        global_batch_size=8, loss=None, loss_scale=1.0, grad_norm=None, skipped=1, nan=0,
    )
    for absent in ("lm loss", "grad norm", "throughput", "MFU", "tokens per second", "memory"):
        assert absent not in line


def test_small_throughput_keeps_significant_digits():
    line = format_log_line(
        iteration=1, train_iters=2, consumed_samples=8, elapsed_ms=1.0, learning_rate=1e-3,
        global_batch_size=8, loss=1.0, loss_scale=1.0, grad_norm=1.0, skipped=0, nan=0, tflops_per_gpu=0.00312,
    )
    assert _field(line, "throughput per GPU (TFLOP/s/GPU)") == "0.00312"  # not Megatron's 0.0 on CPU


def test_interval_averages_like_megatron():
    records = [
        _record(1, loss=2.0, elapsed_ms=100.0, tflops_per_gpu=1.0),
        _record(2, loss=99.0, skipped=1, elapsed_ms=200.0, tflops_per_gpu=1.0),  # skipped: no loss
        _record(3, loss=float("nan"), skipped=1, nan=1, elapsed_ms=300.0, tflops_per_gpu=4.0),
        _record(4, loss=4.0, skipped=1, nan=1, elapsed_ms=400.0, tflops_per_gpu=4.0, lr=1e-4),
    ]
    s = summarize_interval(records, skipped_before=0, nan_before=0)
    assert s["loss"] == pytest.approx(3.0)  # mean of iterations 1 and 4
    assert s["elapsed_ms"] == pytest.approx(250.0)
    assert s["skipped"] == 1 and s["nan"] == 1
    assert s["learning_rate"] == 1e-4  # the latest, not an average
    assert s["tflops_per_gpu"] == pytest.approx((100 + 200 + 1200 + 1600) / 1000)  # work / time
    # Counts are per interval: a second interval after these records starts from 1/1.
    later = summarize_interval([_record(5, skipped=3, nan=1)], skipped_before=1, nan_before=1)
    assert later["skipped"] == 2 and later["nan"] == 0 and later["loss"] is None


def test_eval_block():
    text = format_eval_block(100, "validation", 2.0)
    rule, line, rule2 = text.split("\n")
    assert rule == rule2 and set(rule) == {"-"} and len(rule) == len(line) + 1
    assert "validation loss at iteration 100 |" in line
    assert float(_field(line, "lm loss value")) == pytest.approx(2.0)
    assert float(_field(line, "lm loss PPL")) == pytest.approx(math.exp(2.0), rel=1e-6)
    assert "on test set" in format_eval_block(100, "test", 1.0)


def test_logger_writes_jsonl_prints_every_interval(tmp_path, capsys):
    cfg = LoggingConfig(log_interval=2, metrics_file=str(tmp_path / "sub" / "metrics.jsonl"))
    logger = MetricsLogger(cfg, total_iters=4, is_logging_rank=True)
    logger.log(_record(1, loss=1.0))
    assert capsys.readouterr().out == ""
    logger.log(_record(2, loss=3.0, grad_norm=torch.tensor(2.5)))
    out = capsys.readouterr().out
    assert "iteration        2/       4" in out and _field(out, "lm loss") == "2.000000E+00"
    logger.log(_record(3, loss=float("inf"), nan=1))
    logger.log(_record(4, loss=5.0, nan=1, mem_peak_gib=0.5))
    out = capsys.readouterr().out
    assert _field(out, "lm loss") == "5.000000E+00" and int(_field(out, "number of nan iterations")) == 1
    logger.close()

    lines = (tmp_path / "sub" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    objs = [json.loads(ln) for ln in lines]
    for i, obj in enumerate(objs, start=1):
        assert list(obj) == list(METRICS_KEYS)
        assert obj["iteration"] == i and obj["mfu"] is None
    assert objs[1]["grad_norm"] == 2.5 and objs[2]["loss"] is None  # inf -> null
    # Append mode: a resumed run continues the same file.
    logger = MetricsLogger(cfg, total_iters=4, is_logging_rank=True, resumed=True)
    logger.log(_record(5))
    logger.close()
    assert len((tmp_path / "sub" / "metrics.jsonl").read_text().splitlines()) == 5


def test_resumed_logger_counts_from_the_checkpoints_totals(capsys):
    """A run resumed with 13 skipped iterations behind it: its first interval reports the
    iterations skipped within the interval (0), and averages the first resumed iteration too."""
    logger = MetricsLogger(LoggingConfig(log_interval=2), total_iters=30, is_logging_rank=True, skipped_before=13, nan_before=1)
    logger.log(_record(21, loss=1.0, skipped=13, nan=1))
    logger.log(_record(22, loss=3.0, skipped=13, nan=1))
    out = capsys.readouterr().out
    assert int(_field(out, "number of skipped iterations")) == 0 and int(_field(out, "number of nan iterations")) == 0
    assert _field(out, "lm loss") == "2.000000E+00"


def test_logger_rejects_misspelled_keys(tmp_path):
    logger = MetricsLogger(LoggingConfig(), total_iters=4, is_logging_rank=True)
    bad = _record(1)
    bad["grad-norm"] = bad.pop("grad_norm")
    with pytest.raises(ValueError, match="grad-norm"):
        logger.log(bad)


def test_non_logging_rank_is_silent(tmp_path, capsys):
    cfg = LoggingConfig(log_interval=1, metrics_file=str(tmp_path / "m.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    logger = MetricsLogger(cfg, total_iters=1, is_logging_rank=False)
    logger.log(_record(1))
    logger.log_eval(1, "validation", 1.0)
    logger.close()
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "tb").exists()


def test_tensorboard_scalars(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    cfg = LoggingConfig(log_interval=1, tensorboard_dir=str(tb))
    logger = MetricsLogger(cfg, total_iters=2, is_logging_rank=True, run_config_toml="[model]\nnum_layers = 2")
    logger.log(_record(1, loss=3.0, mem_allocated_gib=1.0))
    logger.log(_record(2, loss=2.5))
    logger.log_eval(2, "validation", 2.25, consumed_samples=16)
    logger.close()
    assert "validation loss at iteration 2" in capsys.readouterr().out
    assert any(p.name.startswith("events.out.tfevents") for p in tb.iterdir())

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "loss-scale", "batch-size",
                "throughput", "tokens-per-second", "iteration-time", "mem-allocated-gib",
                "lm loss validation", "lm loss validation ppl"):
        assert tag in tags, tag
    assert "mfu" not in tags  # None is never plotted
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(1, 3.0), (2, 2.5)]
    assert [e.step for e in acc.Scalars("lm loss vs samples")] == [8, 16]


def test_timers_reach_the_line_tensorboard_and_the_file_per_iteration(tmp_path, capsys, monkeypatch):
    """An interval's timer totals are divided by its iterations (a resumed run's first interval
    is shorter than log_interval) and written as `<phase>-time` and `timers_ms`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    now = [0.0]
    monkeypatch.setattr("dtgpt.timers.time.perf_counter", lambda: now[0])
    timers = Timers(1, torch.device("cpu"))
    cfg = LoggingConfig(log_interval=4, metrics_file=str(tmp_path / "m.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    logger = MetricsLogger(cfg, total_iters=8, is_logging_rank=True)
    for it, ms in ((3, 30.0), (4, 10.0), (5, 5.0), (6, 5.0), (7, 5.0), (8, 25.0)):  # resumed after iteration 2
        with timers("forward-backward"):
            now[0] += ms / 1000
        logger.log(_record(it), timers)
    logger.close()
    out = capsys.readouterr().out
    assert out.count("(min, max) time across ranks (ms):") == 2
    assert re.search(r"forward-backward \.+: \(20\.00, 20\.00\)", out)  # (30 + 10) / 2 iterations
    assert re.search(r"forward-backward \.+: \(10\.00, 10\.00\)", out)  # (5 + 5 + 5 + 25) / 4
    lines = [json.loads(ln) for ln in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [i for i, ln in enumerate(lines) if "timers_ms" in ln] == [1, 5]  # the lines closing an interval
    assert lines[1]["timers_ms"]["forward-backward"] == pytest.approx([20.0, 20.0])
    assert lines[5]["timers_ms"]["forward-backward"] == pytest.approx([10.0, 10.0])
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = acc.Scalars("forward-backward-time")
    assert [e.step for e in scalars] == [4, 8] and [e.value for e in scalars] == pytest.approx([20.0, 10.0])


def test_peak_table_lookup_and_override():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert lookup_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert lookup_peak_tflops("NVIDIA A10G") == 125.0
    assert lookup_peak_tflops("NVIDIA L4") == 121.0
    assert lookup_peak_tflops("NVIDIA L40S") == 362.0
    assert lookup_peak_tflops("NVIDIA H200") == 989.0
    assert lookup_peak_tflops("Tesla V100-SXM2-32GB") == 125.0
    assert lookup_peak_tflops("Some Future Accelerator") is None
    names = [name.lower() for name, _ in DEVICE_PEAK_TFLOPS]
    for i, earlier in enumerate(names):  # an earlier name inside a later one would shadow it
        assert not any(earlier in later for later in names[i + 1:]), earlier
    with pytest.raises(TypeError):
        DEVICE_PEAK_TFLOPS[0] = ("X", 1.0)  # immutable
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, 0.0) is None
    assert peak_tflops(cpu, 100.0) == 100.0


def test_mfu_none_on_cpu_and_throughput_math():
    peak = peak_tflops(torch.device("cpu"), 0.0)
    m = throughput_metrics(tokens=4096, flops_per_token=6e9, elapsed_s=2.0, world_size=4, peak=peak)
    assert m["mfu"] is None
    assert m["tokens_per_s"] == 2048.0
    assert m["tflops_per_gpu"] == pytest.approx(4096 * 6e9 / (2.0 * 4 * 1e12))
    with_peak = throughput_metrics(tokens=4096, flops_per_token=6e9, elapsed_s=2.0, world_size=4, peak=10.0)
    assert with_peak["mfu"] == pytest.approx(m["tflops_per_gpu"] / 10.0)
    assert memory_stats(torch.device("cpu")) == {}


@pytest.mark.parametrize(
    "schedule, pp, vpp, world, logging_rank",
    [
        ("1F1B", 1, 1, 4, 3),  # no pipeline: Megatron's last rank
        ("1F1B", 2, 1, 4, 3),  # pp rank 1 (ranks 2, 3) holds stage 1
        ("Interleaved1F1B", 2, 2, 4, 3),  # stages 0, 2 | 1, 3: the last is on pp rank 1
        ("ZBVZeroBubble", 2, 2, 4, 1),  # V: pp rank 0 holds stages 0 and 3 (ranks 0, 1)
        ("DualPipeV", 2, 2, 2, 0),
        ("DualPipeV", 4, 2, 8, 1),  # stages 0 and 7 on pp rank 0 (ranks 0, 1)
    ],
)
def test_metrics_are_logged_by_the_last_rank_holding_the_last_stage(schedule, pp, vpp, world, logging_rank):
    from dtgpt.config import load_config
    from dtgpt.distributed import Runtime
    from dtgpt.parallel import ParallelDims, last_stage_rank

    cfg = load_config(None, ["--model.num_layers=8", f"--parallel.pipeline_model_parallel_size={pp}",
                             f"--parallel.pipeline_schedule={schedule}", f"--parallel.virtual_pipeline_stages_per_rank={vpp}",
                             "--training.global_batch_size=16", "--data.mock_data=true"])  # fmt: skip
    assert last_stage_rank(cfg, world) == logging_rank
    dims = ParallelDims.from_config(cfg, world)
    runtimes = [Runtime(rank, world, 0, torch.device("cpu"), dims, logging_rank=last_stage_rank(cfg, world)) for rank in range(world)]
    assert [r.rank for r in runtimes if r.is_logging_rank] == [logging_rank]


def test_a_fresh_run_sets_an_earlier_runs_metrics_aside(tmp_path, capsys):
    """Records of two unrelated runs never mix in one file; a resumed run continues its own."""
    path = tmp_path / "metrics.jsonl"
    cfg = LoggingConfig(log_interval=100, metrics_file=str(path))
    for run in range(2):  # two fresh runs: iterations 1-2 each
        logger = MetricsLogger(cfg, total_iters=4, is_logging_rank=True)
        logger.log(_record(1, loss=1.0 + run))
        logger.log(_record(2, loss=1.0 + run))
        logger.close()
    assert "held an earlier run's records: moved them to" in capsys.readouterr().out
    resumed = MetricsLogger(cfg, total_iters=4, is_logging_rank=True, resumed=True)
    resumed.log(_record(3, loss=2.0))
    resumed.close()
    lines = lambda p: [json.loads(line) for line in p.read_text().splitlines()]  # noqa: E731
    assert [(r["iteration"], r["loss"]) for r in lines(tmp_path / "metrics.jsonl.1")] == [(1, 1.0), (2, 1.0)]
    assert [(r["iteration"], r["loss"]) for r in lines(path)] == [(1, 2.0), (2, 2.0), (3, 2.0)]


def test_a_failed_timers_reduction_still_records_the_iteration(tmp_path):
    """A peer dies in the reduction after the iteration completed: last words save it and the
    restart resumes after it, so its record must be written now, without the times."""

    class DeadPeer:
        def min_max(self, iterations):
            raise RuntimeError("Connection reset by peer")

    cfg = LoggingConfig(log_interval=1, metrics_file=str(tmp_path / "m.jsonl"))
    logger = MetricsLogger(cfg, total_iters=8, is_logging_rank=True)
    with pytest.raises(RuntimeError, match="reset by peer"):
        logger.log(_record(4), DeadPeer())
    logger.close()
    (line,) = [json.loads(ln) for ln in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert line["iteration"] == 4 and "timers_ms" not in line


def test_a_replacement_of_the_logging_rank_writes_its_twins_last_record_once(tmp_path, capsys):
    """In-process recovery hands a replacement its twin's `kept`: the last iteration's record and
    the open interval. The logging rank died after the step of iteration 3, before its line: the
    replacement writes it (file and log line); had it died after the line, nothing is written
    twice. Either way the file and the next line equal an uninterrupted logger's."""
    losses = {1: 1.0, 2: 2.0, 3: 3.0, 4: 5.0}
    reference = MetricsLogger(LoggingConfig(log_interval=2, metrics_file=str(tmp_path / "ref.jsonl")), 4, True)
    for it, loss in losses.items():
        reference.log(_record(it, loss=loss))
    reference.close()
    want_line = capsys.readouterr().out.splitlines()[-1]
    cfg = LoggingConfig(log_interval=2, metrics_file=str(tmp_path / "m.jsonl"))
    logging_rank, twin = MetricsLogger(cfg, 4, True), MetricsLogger(cfg, 4, False)
    for it in (1, 2, 3):
        twin.log(_record(it, loss=losses[it]))
        if it < 3:
            logging_rank.log(_record(it, loss=losses[it]))
    logging_rank.close()  # killed after the step of 3
    replacement = MetricsLogger(cfg, 4, True, resumed=True)
    replacement.take_over(twin.kept)
    assert last_recorded_iteration(cfg.metrics_file) == 3 and replacement.kept == twin.kept  # (its own to hand over)
    again = MetricsLogger(cfg, 4, True, resumed=True)  # the same replacement, had the line been written
    again.take_over(twin.kept)
    again.close()
    replacement.log(_record(4, loss=losses[4]))
    replacement.close()
    assert (tmp_path / "m.jsonl").read_text() == (tmp_path / "ref.jsonl").read_text()
    got_line = capsys.readouterr().out.splitlines()[-1]
    assert "iteration        4/       4" in got_line and _field(got_line, "lm loss") == _field(want_line, "lm loss")
    MetricsLogger(cfg, 4, True, resumed=True).take_over(None)  # a death before any record: nothing to write


def test_the_last_recorded_iteration_is_read_from_the_files_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    assert last_recorded_iteration(str(path)) == 0  # no file yet
    path.write_text("")
    assert last_recorded_iteration(str(path)) == 0
    long = json.dumps({"iteration": 7, "tokens_per_expert": [[1] * 1000] * 60})  # a line past the first window
    path.write_text(json.dumps({"iteration": 6}) + "\n" + long + "\n")
    assert last_recorded_iteration(str(path)) == 7
    path.write_text(json.dumps({"iteration": 6}) + "\n" + '{"iteration": 7, "lo')  # cut short by a death
    assert last_recorded_iteration(str(path)) == 6
