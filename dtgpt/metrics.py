"""What a run reports: the Megatron-style log line, TensorBoard scalars, a JSONL file, MFU, memory.

The trainer builds one record per iteration (see `RECORD_KEYS`) and hands it to
`MetricsLogger.log` on the logging rank. The logger writes the record to the JSONL file and
TensorBoard at once, and every `log_interval` iterations prints one line averaged over the
interval the way Megatron averages it. Formatting is the pure function `format_log_line`.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime
from typing import Any, Mapping, Optional

import torch

from dtgpt.config import LoggingConfig

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
MEMORY_KEYS: tuple[str, ...] = ("mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib")
# What `MetricsLogger.log` requires (memory keys are optional); anything else is a typo.
RECORD_KEYS: tuple[str, ...] = METRICS_KEYS + ("elapsed_ms",)

_GIB = float(2**30)
# exp() of a diverged loss overflows; Megatron caps the exponent at 20 for the same reason.
_MAX_PPL_EXPONENT = 20.0


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


# ---------------------------------------------------------------------------------------------
# Pure formatting and averaging


def format_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: Optional[float],
    learning_rate: Optional[float],
    global_batch_size: int,
    loss: Optional[float],
    loss_scale: Optional[float],
    grad_norm: Optional[float],
    skipped: int,
    nan: int,
    tflops_per_gpu: Optional[float] = None,
    tokens_per_s: Optional[float] = None,
    mfu: Optional[float] = None,
    memory: Optional[Mapping[str, float]] = None,
    now: Optional[datetime] = None,
) -> str:
    """One training log line. Megatron's fields keep Megatron's names, widths and order so
    existing log parsers work; the fields Megatron lacks (tokens/s, MFU, memory) come last.
    A field whose value is None is left out, as Megatron leaves out an unknown grad norm."""
    stamp = (now or datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
    fields = [
        f" [{stamp}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
    ]
    if elapsed_ms is not None:
        fields.append(f"elapsed time per iteration (ms): {elapsed_ms:.1f}")
    if tflops_per_gpu is not None:
        # Megatron's one decimal, except below 1 where it would print 0.0 for every CPU run.
        shown = f"{tflops_per_gpu:.1f}" if tflops_per_gpu >= 1 else f"{tflops_per_gpu:.3g}"
        fields.append(f"throughput per GPU (TFLOP/s/GPU): {shown}")
    if learning_rate is not None:
        fields.append(f"learning rate: {learning_rate:.6E}")
    fields.append(f"global batch size: {global_batch_size:5d}")
    if loss is not None:
        fields.append(f"lm loss: {loss:.6E}")
    if loss_scale is not None:
        fields.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        fields.append(f"grad norm: {grad_norm:.3f}")
    fields.append(f"number of skipped iterations: {skipped:3d}")
    fields.append(f"number of nan iterations: {nan:3d}")
    if tokens_per_s is not None:
        fields.append(f"tokens per second: {tokens_per_s:.1f}")
    if mfu is not None:
        fields.append(f"MFU: {100.0 * mfu:.2f}%")
    memory = memory or {}
    for key, label in zip(MEMORY_KEYS, ("memory allocated", "memory reserved", "memory peak allocated")):
        if memory.get(key) is not None:
            fields.append(f"{label} (GiB): {memory[key]:.2f}")
    return " | ".join(fields) + " |"


def format_eval_block(iteration: int, split_name: str, loss: float) -> str:
    """Megatron's validation block: the result line framed by dashes of its length."""
    where = f"iteration {iteration}"
    if split_name not in ("valid", "validation"):
        where += f" on {split_name} set"
    ppl = math.exp(min(loss, _MAX_PPL_EXPONENT))
    line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def _is_number(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def _time_weighted(records: list[Mapping[str, Any]], key: str) -> Optional[float]:
    """A rate over the interval: sum(rate_i * t_i) / sum(t_i), i.e. total work / total time,
    which a plain mean of per-iteration rates is not when iteration times differ."""
    pairs = [(r[key], r.get("elapsed_ms")) for r in records if _is_number(r.get(key))]
    if not pairs:
        return None
    if all(_is_number(t) and t > 0 for _, t in pairs):
        return sum(v * t for v, t in pairs) / sum(t for _, t in pairs)
    return sum(v for v, _ in pairs) / len(pairs)


def summarize_interval(
    records: list[Mapping[str, Any]], skipped_before: int, nan_before: int
) -> dict[str, Any]:
    """The averages of one log interval, as `format_log_line` keywords (less iteration,
    train_iters, now). `skipped`/`nan` in records are counts since the run started; the
    *_before arguments are those counts at the end of the previous interval.

    Like Megatron: the loss is the mean over iterations that were neither skipped nor
    non-finite, the time per iteration is the mean over all of them, skipped/nan are counts
    within the interval, and lr, batch size, loss scale, grad norm, memory are the latest values.
    """
    last = records[-1]
    losses = []
    prev_skipped, prev_nan = skipped_before, nan_before
    for r in records:
        counted = r["skipped"] == prev_skipped and r["nan"] == prev_nan
        if counted and _is_number(r["loss"]):
            losses.append(r["loss"])
        prev_skipped, prev_nan = r["skipped"], r["nan"]
    times = [r["elapsed_ms"] for r in records if _is_number(r.get("elapsed_ms"))]
    return {
        "consumed_samples": last["consumed_samples"],
        "elapsed_ms": sum(times) / len(times) if times else None,
        "learning_rate": last["lr"],
        "global_batch_size": last["global_batch_size"],
        "loss": sum(losses) / len(losses) if losses else None,
        "loss_scale": last["loss_scale"],
        "grad_norm": last["grad_norm"] if _is_number(last["grad_norm"]) else None,
        "skipped": last["skipped"] - skipped_before,
        "nan": last["nan"] - nan_before,
        "tflops_per_gpu": _time_weighted(records, "tflops_per_gpu"),
        "tokens_per_s": _time_weighted(records, "tokens_per_s"),
        "mfu": _time_weighted(records, "mfu"),
        "memory": {k: last[k] for k in MEMORY_KEYS if k in last},
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


def metrics_json_line(record: Mapping[str, Any]) -> str:
    """The JSONL line for one record: exactly METRICS_KEYS, in that order."""
    return json.dumps({k: _json_value(record[k]) for k in METRICS_KEYS}, allow_nan=False)


def check_record(record: Mapping[str, Any]) -> None:
    """Reject a record with a missing or misspelled key now, not as a silently empty chart."""
    missing = [k for k in RECORD_KEYS if k not in record]
    unknown = [k for k in record if k not in RECORD_KEYS and k not in MEMORY_KEYS]
    if missing or unknown:
        raise ValueError(
            f"metrics record: missing keys {missing}, unknown keys {unknown}; "
            f"expected {list(RECORD_KEYS)} plus optional {list(MEMORY_KEYS)}"
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
    ) -> None:
        self.cfg = cfg
        self.total_iters = total_iters
        self.active = is_logging_rank
        self._interval: list[dict[str, Any]] = []
        # Counts at the end of the last printed interval: those the run started with (a resumed
        # run's records carry the checkpoint's cumulative counts).
        self._skipped_before = skipped_before
        self._nan_before = nan_before
        self._file = None
        self.writer = None
        if not self.active:
            return
        if cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_file)), exist_ok=True)
            # Append: a resumed run continues the same file (an iteration redone after a
            # restart appears twice; readers keep the last line per iteration).
            self._file = open(cfg.metrics_file, "a", encoding="utf-8")
        if cfg.tensorboard_dir:
            self.writer = _open_summary_writer(cfg.tensorboard_dir)
            if run_config_toml:
                # Indented so TensorBoard's markdown renders it verbatim.
                self.writer.add_text("config", "\n".join("    " + ln for ln in run_config_toml.splitlines()))

    def log(self, record: Mapping[str, Any]) -> None:
        """Record one iteration; prints the averaged line when iteration % log_interval == 0."""
        if not self.active:
            return
        check_record(record)
        record = {k: _json_value(v) for k, v in record.items()}
        if self._file is not None:
            self._file.write(metrics_json_line(record) + "\n")
            self._file.flush()
        if self.writer is not None:
            self._write_scalars(record)
        self._interval.append(record)
        if record["iteration"] % self.cfg.log_interval == 0:
            self._print_interval(record["iteration"])

    def _write_scalars(self, record: Mapping[str, Any]) -> None:
        step = record["iteration"]
        for key, tag in _TB_SCALARS:
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], step)
        for key, tag in _TB_VS_SAMPLES:
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], record["consumed_samples"])
        if record.get("elapsed_ms") is not None:
            self.writer.add_scalar("iteration-time", record["elapsed_ms"] / 1000.0, step)

    def _print_interval(self, iteration: int) -> None:
        summary = summarize_interval(self._interval, self._skipped_before, self._nan_before)
        print(format_log_line(iteration=iteration, train_iters=self.total_iters, **summary), flush=True)
        self._skipped_before = self._interval[-1]["skipped"]
        self._nan_before = self._interval[-1]["nan"]
        self._interval = []

    def log_eval(
        self, iteration: int, split_name: str, loss: float, consumed_samples: Optional[int] = None
    ) -> None:
        """Print Megatron's validation block and write `lm loss <split>` (and its PPL) to TensorBoard."""
        if not self.active:
            return
        loss = float(loss)
        print(format_eval_block(iteration, split_name, loss), flush=True)
        if self.writer is not None:
            ppl = math.exp(min(loss, _MAX_PPL_EXPONENT))
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
