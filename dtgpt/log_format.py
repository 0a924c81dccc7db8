"""The text a run prints: Megatron's log line, its validation block, the interval averages.

Pure functions of the per-iteration records that dtgpt.metrics.MetricsLogger collects.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Mapping, Optional

MEMORY_KEYS: tuple[str, ...] = ("mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib")
# Megatron's names of the MoE router losses it logs (dtgpt/moe/stats.py), then the routing counts.
MOE_LOSS_KEYS: tuple[str, ...] = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")
MOE_KEYS: tuple[str, ...] = MOE_LOSS_KEYS + ("tokens_per_expert", "dropped_tokens")


def moe_layer_loss_key(name: str, layer: int) -> str:
    """One MoE layer's router loss (model.moe_per_layer_logging), Megatron's tensorboard tag
    `moe/<loss>_layer_<i>`, i the block's number from 0 (multi-token prediction's after the blocks)."""
    return f"moe/{name}_layer_{layer}"


def is_moe_layer_loss_key(key: str) -> bool:
    name, _, layer = key.removeprefix("moe/").rpartition("_layer_")
    return key.startswith("moe/") and name in MOE_LOSS_KEYS and layer.isdigit()


def is_mtp_loss_key(key: str) -> bool:
    """Whether `key` is a multi-token prediction depth's loss, Megatron's `mtp_<k> loss` (dtgpt/mtp.py)."""
    return key.startswith("mtp_") and key.endswith(" loss") and key[4:-5].isdigit()


def side_loss_keys(record: Mapping[str, Any]) -> list[str]:
    """The losses a record holds beside the LM loss: the router's, then each prediction depth's."""
    return [k for k in MOE_LOSS_KEYS if k in record] + sorted((k for k in record if is_mtp_loss_key(k)), key=lambda k: int(k[4:-5]))
# exp() of a diverged loss overflows; Megatron caps the exponent at 20 for the same reason.
_MAX_PPL_EXPONENT = 20.0


def perplexity(loss: float) -> float:
    return math.exp(min(loss, _MAX_PPL_EXPONENT))


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
    side_losses: Optional[Mapping[str, float]] = None,
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
    for name, value in (side_losses or {}).items():  # after lm loss, as Megatron prints them
        fields.append(f"{name}: {value:.6E}")
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
    ppl = perplexity(loss)
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


def _mean(records: list[Mapping[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in records if _is_number(r.get(key))]
    return sum(values) / len(values) if values else None


def summarize_interval(
    records: list[Mapping[str, Any]], skipped_before: int, nan_before: int
) -> dict[str, Any]:
    """The averages of one log interval, as `format_log_line` keywords (less iteration,
    train_iters, now). `skipped`/`nan` in records are counts since the run started; the
    *_before arguments are those counts at the end of the previous interval.

    Like Megatron: the loss is the mean over iterations that were neither skipped nor
    non-finite, the time per iteration is the mean over all of them, skipped/nan are counts
    within the interval, and lr, batch size, loss scale, grad norm, memory are the latest values;
    the MoE router losses and the prediction depths' are means over the interval's iterations, as
    Megatron prints them.
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
        "side_losses": {k: v for k in side_loss_keys(last) if (v := _mean(records, k)) is not None},
    }
