#!/usr/bin/env python
"""The host cost of dtgpt's training step against the plain loop's, where the math is nil.

    python scripts/bench_host.py                 # bf16 and fp32, the ratios
    python scripts/bench_host.py --precision bf16 --steps 30 --rounds 5

A GPU step is bounded below by the host time spent issuing it: at small widths and micro-batches
the host, not the GPU, sets the pace (docs/performance.md). On a CPU, with a model whose math is
nil (12 layers like 124m, hidden 16, 2 heads, seq 16, micro-batch 1, a small vocabulary), the
time of a step is that host time, and the aten ops it dispatches stand for the kernels a GPU
would launch. Both sides run in one process, built side by side and interleaved round by round,
so load on the machine falls on both alike: dtgpt's `train_step` as the trainer runs it
(scripts/bench.py's dtgpt side) and the plain loop of scripts/bench.py (autocast in bf16).

Host time per step is the median over rounds of the mean step time of a round; aten ops per step
are counted by torch.profiler over one step (every `aten::` event, nested ones included: DTensor's
and FSDP's work on local tensors is counted too). Ratios are dtgpt / plain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (scripts/bench.py: both sides' steps)

from dtgpt.distributed import shutdown  # noqa: E402
from dtgpt.profiling import count_ops_profile  # noqa: E402

NIL = (12, 16, 2, 16, 1)  # layers, hidden, heads, seq, micro-batch: 124m's depth, no math


def nil_config(precision: str, vocab: int):
    bench.SIZES["nil"] = NIL
    bench.VOCAB_SIZE = vocab
    cfg = bench.bench_config("nil", "cpu", bf16=precision == "bf16")
    cfg.model.make_vocab_size_divisible_by = 1
    return cfg


def aten_ops(step, batch: torch.Tensor) -> int:
    with count_ops_profile() as prof:
        step(batch)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def measure(precision: str, steps: int, rounds: int, warmup: int, vocab: int) -> dict:
    """Both sides in this process: {side: (ms per step, aten ops per step)} and the ratios."""
    cfg = nil_config(precision, vocab)
    device = torch.device("cpu")
    sides = {"dtgpt": bench.dtgpt_step(cfg, device)[0], "plain": bench.reference_step(cfg, device)[0]}
    batches = bench.make_batches(cfg, device, 4, on_host=False)
    for step in sides.values():
        for i in range(warmup):
            step(batches[i % len(batches)])
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in sorted(sides, reverse=r % 2 == 1):  # ABBA
            step = sides[name]
            start = time.perf_counter()
            for i in range(steps):
                step(batches[i % len(batches)])
            times[name].append(1000 * (time.perf_counter() - start) / steps)
    result = {name: {"ms": statistics.median(ts), "ops": aten_ops(sides[name], batches[0])} for name, ts in times.items()}
    result["ratio"] = {k: result["dtgpt"][k] / result["plain"][k] for k in ("ms", "ops")}
    return result


def check_counts(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--steps, --rounds and --vocab of 1 or more, --warmup of 0 or more (no steps divided by
    zero, no rounds took the median of nothing)."""
    for name, least in (("steps", 1), ("rounds", 1), ("vocab", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            p.error(f"--{name}={getattr(args, name)} must be {least} or more")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="bf16,fp32", help="comma-separated of bf16, fp32")
    p.add_argument("--steps", type=int, default=20, help="steps per round and side")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the order alternating")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (small: the math stays nil)")
    args = p.parse_args(argv)
    check_counts(p, args)
    for precision in args.precision.split(","):
        if precision.strip() not in ("bf16", "fp32"):
            p.error(f"--precision={args.precision!r}: {precision.strip()!r} is not bf16 or fp32")  # fp32 ran under its name
    torch.set_num_threads(1)
    layers, hidden, heads, seq, micro = NIL
    print(f"nil width: {layers} layers, hidden {hidden}, {heads} heads, seq {seq}, micro-batch {micro}, "
          f"vocab {args.vocab}; torch {torch.__version__}, 1 thread")  # fmt: skip
    print(f"{'precision':<10} {'dtgpt ms':>9} {'plain ms':>9} {'host ratio':>10} {'dtgpt ops':>10} {'plain ops':>10} {'ops ratio':>9}")
    try:
        for precision in args.precision.split(","):
            r = measure(precision.strip(), args.steps, args.rounds, args.warmup, args.vocab)
            d, ref = r["dtgpt"], r["plain"]
            print(f"{precision:<10} {d['ms']:>9.2f} {ref['ms']:>9.2f} {r['ratio']['ms']:>10.2f} "
                  f"{d['ops']:>10} {ref['ops']:>10} {r['ratio']['ops']:>9.2f}", flush=True)  # fmt: skip
    finally:
        shutdown(clean=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
