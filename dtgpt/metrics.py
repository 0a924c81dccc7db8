"""What a run reports: the Megatron-style log line, TensorBoard scalars, a JSONL file, MFU, memory.

The trainer builds one record per iteration (see `RECORD_KEYS`) and hands it to
`MetricsLogger.log` on the logging rank. The logger writes the record to the JSONL file and
TensorBoard at once, and every `log_interval` iterations prints one line averaged over the
interval the way Megatron averages it, then the phase timers' per-iteration (min, max) when
`logging.timers_log_level` > 0. Formatting is dtgpt.log_format's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional

import torch

from dtgpt.config import LoggingConfig
from dtgpt.log_format import MEMORY_KEYS, MOE_KEYS, MOE_LOSS_KEYS, is_moe_layer_loss_key, is_mtp_loss_key, format_eval_block, format_log_line, perplexity, summarize_interval
from dtgpt.timers import Timers, format_times

# Dense (no 2:4 sparsity) bf16 tensor-core peaks in TFLOP/s per device, fp16 for V100/T4 that
# lack bf16. Matched as case-insensitive substrings of `torch.cuda.get_device_name()`, first
# match wins, so a specific name must come before any name it contains ("A100" before "A10",
# "H100 PCIe" before "H100"); a test checks that ordering.
DEVICE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM reports itself as e.g. "NVIDIA H100 80GB HBM3"
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A10G", 125.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("V100", 125.0),
    ("T4", 65.0),
    ("MI300X", 1307.0),
)

# The DESIGN's JSONL schema: every line has exactly these keys, in this order.
METRICS_KEYS: tuple[str, ...] = (
    "iteration",
    "consumed_samples",
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "global_batch_size",
    "skipped",
    "nan",
    "tokens_per_s",
    "tflops_per_gpu",
    "mfu",
)
# What `MetricsLogger.log` requires (memory keys are optional); anything else is a typo.
RECORD_KEYS: tuple[str, ...] = METRICS_KEYS + ("elapsed_ms",)

_GIB = float(2**30)


# ---------------------------------------------------------------------------------------------
# Peak FLOP/s, throughput, memory


def lookup_peak_tflops(device_name: str) -> Optional[float]:
    """The table's peak for a device name, or None when no entry matches."""
    lowered = device_name.lower()
    for key, tflops in DEVICE_PEAK_TFLOPS:
        if key.lower() in lowered:
            return tflops
    return None


def peak_tflops(device: torch.device, override: float = 0.0) -> Optional[float]:
    """Peak TFLOP/s of one device for MFU: `override` when > 0, else the table; None on CPU or
    an unknown GPU, which turns MFU reporting off rather than guessing."""
    if override > 0:
        return float(override)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name(device))


def throughput_metrics(
    *, tokens: int, flops_per_token: float, elapsed_s: float, world_size: int, peak: Optional[float]
) -> dict[str, Optional[float]]:
    """tokens_per_s (whole job), tflops_per_gpu and mfu (a fraction, None without a peak) for one
    iteration that processed `tokens` tokens in `elapsed_s` seconds on `world_size` devices."""
    tokens_per_s = tokens / elapsed_s
    tflops_per_gpu = flops_per_token * tokens / (elapsed_s * world_size * 1e12)
    mfu = tflops_per_gpu / peak if peak else None
    return {"tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops_per_gpu, "mfu": mfu}


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocated, reserved and peak-allocated GiB on a CUDA device; {} elsewhere."""
    if device.type != "cuda":
        return {}
    return {
        "mem_allocated_gib": torch.cuda.memory_allocated(device) / _GIB,
        "mem_reserved_gib": torch.cuda.memory_reserved(device) / _GIB,
        "mem_peak_gib": torch.cuda.max_memory_allocated(device) / _GIB,
    }


def _json_value(value: Any) -> Any:
    """Plain JSON: 0-dim tensors become numbers, NaN/inf become null (strict JSON has neither)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def metrics_json_line(record: Mapping[str, Any], times: Optional[Mapping[str, tuple[float, float]]] = None) -> str:
    """The JSONL line for one record: exactly METRICS_KEYS, in that order, then those of MOE_KEYS
    an MoE run records (Megatron's router losses, tokens_per_expert [layer][expert], dropped_tokens), then `timers_ms`
    ({phase: [min, max]} per iteration) on the lines that close a log interval with timers on."""
    line = {k: _json_value(record[k]) for k in METRICS_KEYS}
    line.update({k: _json_value(record[k]) for k in MOE_KEYS if k in record})  # MoE runs only
    line.update({k: _json_value(v) for k, v in record.items() if is_mtp_loss_key(k) or is_moe_layer_loss_key(k)})
    if times:
        line["timers_ms"] = {name: [lo, hi] for name, (lo, hi) in times.items()}
    return json.dumps(line, allow_nan=False)


def last_recorded_iteration(path: str) -> int:
    """The iteration of the last record in the metrics file at `path` (0: none). Reads the tail
    only (a long run's file is large), widening it until it holds the last whole line."""
    try:
        with open(path, "rb") as f:
            size, window = f.seek(0, os.SEEK_END), 1 << 16
            while True:
                f.seek(max(0, size - window))
                lines = f.read().rstrip(b"\n").split(b"\n")
                if len(lines) > 1 or window >= size:
                    break
                window *= 2
    except FileNotFoundError:
        return 0
    for line in reversed(lines):  # the last whole record: a death mid-write may have cut the last line short
        try:
            return int(json.loads(line)["iteration"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def _checked(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record, its keys checked, its values plain JSON."""
    check_record(record)
    return {k: _json_value(v) for k, v in record.items()}


def check_record(record: Mapping[str, Any]) -> None:
    """Reject a record with a missing or misspelled key now, not as a silently empty chart."""
    missing = [k for k in RECORD_KEYS if k not in record]
    unknown = [
        k for k in record if k not in RECORD_KEYS and k not in MEMORY_KEYS and k not in MOE_KEYS and not is_mtp_loss_key(k)
        and not is_moe_layer_loss_key(k)
    ]
    if missing or unknown:
        raise ValueError(
            f"metrics record: missing keys {missing}, unknown keys {unknown}; "
            f"expected {list(RECORD_KEYS)} plus optional {list(MEMORY_KEYS + MOE_KEYS)}"
        )


# ---------------------------------------------------------------------------------------------
# TensorBoard tags: (record key, tag). Megatron's tag names where Megatron has the scalar.
_TB_SCALARS: tuple[tuple[str, str], ...] = (
    ("loss", "lm loss"),
    ("lr", "learning-rate"),
    ("grad_norm", "grad-norm"),
    ("loss_scale", "loss-scale"),
    ("global_batch_size", "batch-size"),
    ("tflops_per_gpu", "throughput"),
    ("tokens_per_s", "tokens-per-second"),
    ("mfu", "mfu"),
    ("skipped", "num-skipped-iterations"),
    ("nan", "num-nan-iterations"),
    ("mem_allocated_gib", "mem-allocated-gib"),
    ("mem_reserved_gib", "mem-reserved-gib"),
    ("mem_peak_gib", "mem-peak-gib"),
    *((key, key) for key in MOE_LOSS_KEYS),  # Megatron writes its router losses under their own names
    ("dropped_tokens", "dropped-tokens"),
)
# Also plotted against consumed samples, which stays comparable across batch-size ramp-up.
_TB_VS_SAMPLES: tuple[tuple[str, str], ...] = (
    ("loss", "lm loss vs samples"),
    ("lr", "learning-rate vs samples"),
    ("global_batch_size", "batch-size vs samples"),
)


def _open_summary_writer(log_dir: str) -> Any:
    try:  # imported here so runs without tensorboard_dir never need the package
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RuntimeError(
            f"logging.tensorboard_dir={log_dir!r} is set but the tensorboard package is not "
            "installed: pip install tensorboard, or leave tensorboard_dir empty"
        ) from e
    return SummaryWriter(log_dir=log_dir)


def set_aside(path: str) -> None:
    """A run that starts from iteration 0 writes a file of its own: another run's records in
    `path` are moved to `path.1` (or the first free `.N`), never appended to or deleted."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.rename(path, f"{path}.{n}")
    print(f"> logging.metrics_file={path} held an earlier run's records: moved them to {path}.{n}", flush=True)


class MetricsLogger:
    """Writes each iteration's record and prints the interval line; inert off the logging rank."""

    def __init__(
        self,
        cfg: LoggingConfig,
        total_iters: int,
        is_logging_rank: bool,
        run_config_toml: Optional[str] = None,
        skipped_before: int = 0,
        nan_before: int = 0,
        resumed: bool = False,
    ) -> None:
        self.cfg = cfg
        self.total_iters = total_iters
        self.active = is_logging_rank
        # Kept on every rank: the timers' reduction needs the count everywhere, and a replacement of
        # the logging rank goes on from its twin's (`take_over`).
        self._interval: list[dict[str, Any]] = []
        self._interval_iters = 0
        # Counts at the end of the last printed interval: those the run started with (a resumed
        # run's records carry the checkpoint's cumulative counts).
        self._skipped_before = skipped_before
        self._nan_before = nan_before
        self._file = None
        self.writer = None
        self.kept: Optional[dict[str, Any]] = None
        """The logger before the last record, and that record: what a replacement's logger
        takes over (`take_over`); None before the first."""
        if not self.active:
            return
        if cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_file)), exist_ok=True)
            if not resumed:
                set_aside(cfg.metrics_file)
            # Append: a resumed run continues the same file (an iteration redone after a
            # restart appears twice; readers keep the last line per iteration).
            self._file = open(cfg.metrics_file, "a", encoding="utf-8")
        if cfg.tensorboard_dir:
            self.writer = _open_summary_writer(cfg.tensorboard_dir)
            if run_config_toml:
                # Indented so TensorBoard's markdown renders it verbatim.
                self.writer.add_text("config", "\n".join("    " + ln for ln in run_config_toml.splitlines()))

    def log(self, record: Mapping[str, Any], timers: Optional[Timers] = None) -> None:
        """Record one iteration. When iteration % log_interval == 0, print the averaged line and,
        with `timers`, their per-iteration (min, max) over ranks, also written to TensorBoard as
        `<phase>-time` and to the metrics file. Call it on every rank: closing an interval reduces
        the timers over ranks, and every rank keeps the interval (`kept`)."""
        self.kept = {
            "record": dict(record), "interval": list(self._interval), "interval_iters": self._interval_iters,
            "skipped_before": self._skipped_before, "nan_before": self._nan_before,
        }  # fmt: skip
        self._interval_iters += 1
        closes = record["iteration"] % self.cfg.log_interval == 0
        try:
            times = timers.min_max(self._interval_iters) if closes and timers is not None else {}
        except Exception:
            # A peer died in the reduction after this iteration completed: last words save it and a
            # restart resumes after it, so its record is written here (without the times) or never.
            if self._file is not None:
                self._write_line(_checked(record), {})
            raise
        self._add(record, times, write=self.active)

    def take_over(self, kept: Optional[Mapping[str, Any]]) -> None:
        """A replacement's logger goes on from its replica twin's `kept` (handed over with the train
        state, docs/faults.md): the same open interval and counts, then the twin's last record,
        also written here when the metrics file lacks it (the logging rank died after that
        iteration's step, before its line). The file is the witness: a record it holds is not
        written twice, and without a metrics file none is written."""
        if kept is None:
            return
        self.kept = dict(kept)  # what it hands over in turn, should its twin die before it logs
        self._interval, self._interval_iters = list(kept["interval"]), kept["interval_iters"] + 1
        self._skipped_before, self._nan_before = kept["skipped_before"], kept["nan_before"]
        record = kept["record"]
        missing = self._file is not None and last_recorded_iteration(self.cfg.metrics_file) < record["iteration"]
        self._add(record, {}, write=self.active and missing)

    def _add(self, record: Mapping[str, Any], times: Mapping[str, tuple[float, float]], write: bool) -> None:
        """Count the record into the interval (on every rank), write it where `write` (file and
        TensorBoard), and close the interval at log_interval (the line printed where `write`)."""
        closes = record["iteration"] % self.cfg.log_interval == 0
        if closes:
            self._interval_iters = 0
        record = _checked(record)
        if write:
            self._write_line(record, times)
            if self.writer is not None:
                self._write_scalars(record, times)
        self._interval.append(record)
        if closes:
            if write:
                self._print_interval(record["iteration"], times)
            self._skipped_before, self._nan_before = record["skipped"], record["nan"]
            self._interval = []

    def _write_line(self, record: Mapping[str, Any], times: Mapping[str, tuple[float, float]]) -> None:
        if self._file is not None:
            self._file.write(metrics_json_line(record, times) + "\n")
            self._file.flush()

    def _write_scalars(self, record: Mapping[str, Any], times: Mapping[str, tuple[float, float]]) -> None:
        step = record["iteration"]
        for key, tag in _TB_SCALARS:
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], step)
        for key in (k for k in record if is_mtp_loss_key(k) or is_moe_layer_loss_key(k)):  # Megatron's tags, as named
            if record[key] is not None:
                self.writer.add_scalar(key, record[key], step)
        for key, tag in _TB_VS_SAMPLES:
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], record["consumed_samples"])
        if record.get("elapsed_ms") is not None:
            self.writer.add_scalar("iteration-time", record["elapsed_ms"] / 1000.0, step)
        for name, (_, slowest) in times.items():  # the slowest rank sets the pace, as in Megatron
            self.writer.add_scalar(f"{name}-time", slowest, step)

    def _print_interval(self, iteration: int, times: Mapping[str, tuple[float, float]]) -> None:
        summary = summarize_interval(self._interval, self._skipped_before, self._nan_before)
        print(format_log_line(iteration=iteration, train_iters=self.total_iters, **summary), flush=True)
        if times:
            print(format_times(times), flush=True)

    def log_eval(
        self, iteration: int, split_name: str, loss: float, consumed_samples: Optional[int] = None
    ) -> None:
        """Print Megatron's validation block and write `lm loss <split>` (and its PPL) to TensorBoard."""
        if not self.active:
            return
        loss = float(loss)
        print(format_eval_block(iteration, split_name, loss), flush=True)
        if self.writer is not None:
            ppl = perplexity(loss)
            self.writer.add_scalar(f"lm loss {split_name}", loss, iteration)
            self.writer.add_scalar(f"lm loss {split_name} ppl", ppl, iteration)
            if consumed_samples is not None:
                self.writer.add_scalar(f"lm loss {split_name} vs samples", loss, consumed_samples)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
