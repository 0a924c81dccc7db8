#!/usr/bin/env python
"""Tokens/s of a training step with document masking against plain causal attention, same shape.

    python scripts/bench_documents.py                                  # CPU, 2 x 1024 tokens, documents of ~128
    python scripts/bench_documents.py --device cuda --layers 12 --hidden 768 --heads 12 --batch 8
    python scripts/bench_documents.py --json out.json

Both sides are dtgpt's own train step (scripts/bench.py's setup: the trainer's Config, the mesh of
one, the library's `build_model` and `build_train_state`) on the same samples: documents of `--document-length` tokens on
average, each ended by an eod. "causal" trains on them as one stream (Megatron's default);
"documents" with eod_mask_loss, reset_position_ids and reset_attention_mask on, so each token
attends only within its document (on CUDA in bf16/fp16 flash attention's varlen kernel over the
bounds the batch counted, elsewhere SDPA with an explicit boolean mask: docs/data.md, "Documents
in a sample"); "documents_masked" the same batches without their bounds, so the mask everywhere.
Steps alternate between the sides round by round (ABC CBA), after untimed warm-up.
On a CPU a step is timed in CPU time of this process (run with OMP_NUM_THREADS=1 for a figure a
shared machine does not distort), on a GPU in wall time. The figures printed last are
documents / causal and documents / documents_masked tokens/s (about 1 on a CPU: the same path).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

try:
    import dtgpt  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.config import validate
from dtgpt.data.batch import Batch, TokenOptions, build_batch
from dtgpt.distributed import resolve_device
from dtgpt.api import train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also when loaded by path
from bench import VOCAB_SIZE, bench_config, build_dtgpt, synchronize  # noqa: E402

EOD = VOCAB_SIZE - 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2, help="micro-batch size (one micro-batch per step)")
    p.add_argument("--document-length", type=int, default=128, help="mean tokens per document")
    p.add_argument("--iters", type=int, default=6, help="timed steps per side (even: ABBA rounds)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--json", default="")
    return p.parse_args(argv)


def packed_samples(batch: int, seq: int, document_length: int, count: int) -> list[torch.Tensor]:
    """(batch, seq + 1) random tokens with an eod after each document (lengths 1 .. 2 x mean)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        x = torch.randint(0, EOD, (batch, seq + 1), generator=g)
        for row in x:
            pos = int(torch.randint(1, 2 * document_length, (), generator=g))
            while pos < seq + 1:
                row[pos] = EOD
                pos += int(torch.randint(1, 2 * document_length, (), generator=g))
        out.append(x)
    return out


def time_steps(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device, 0)
    cfg = bench_config("tiny", device.type, bf16=args.bf16)
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = args.layers, args.hidden, args.heads, args.seq
    t.micro_batch_size = t.global_batch_size = args.batch
    validate(cfg, world_size=1)
    state = build_dtgpt(cfg, device)
    documents = TokenOptions(EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    samples = packed_samples(args.batch, args.seq, args.document_length, args.warmup + args.iters)
    sides: dict[str, list[Batch]] = {
        "causal": [build_batch(s).map(lambda x: x.to(device)) for s in samples],
        "documents": [build_batch(s, documents).map(lambda x: x.to(device)) for s in samples],
    }
    sides["documents_masked"] = [replace(b, document_bounds=None) for b in sides["documents"]]

    # On a CPU the process's CPU time: on a shared machine, time spent waiting for a core is not the step's.
    clock = time.process_time if device.type == "cpu" else time.perf_counter

    def step(batch: Batch) -> float:
        synchronize(device)
        start = clock()
        train_step(cfg, state, batch)
        synchronize(device)
        return clock() - start

    for i in range(args.warmup):
        for side in sides:
            step(sides[side][i])
    seconds = {side: 0.0 for side in sides}
    for i in range(args.warmup, args.warmup + args.iters):
        order = list(sides) if (i - args.warmup) % 4 in (0, 3) else list(sides)[::-1]  # ABBA
        for side in order:
            seconds[side] += step(sides[side][i])
    tokens = args.iters * args.batch * args.seq
    per_s = {side: tokens / s for side, s in seconds.items()}
    mean_documents = sum(int(b.document_ids.max(dim=1).values.sum()) + args.batch for b in sides["documents"])
    return {
        "shape": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
                  "batch": args.batch, "bf16": args.bf16},
        "documents_per_sample": mean_documents / (len(samples) * args.batch),
        "tokens_per_s": per_s,
        "clock": "process CPU time" if device.type == "cpu" else "wall",
        "ratio": per_s["documents"] / per_s["causal"],
        "varlen_over_masked": per_s["documents"] / per_s["documents_masked"],
        "environment": {"torch": torch.__version__, "device": str(device), "platform": platform.platform()},
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    report = time_steps(args)
    per_s = report["tokens_per_s"]
    print(f"torch {torch.__version__} on {report['environment']['device']}; shape {report['shape']}, "
          f"{report['documents_per_sample']:.1f} documents per sample")
    print(f"tokens/s ({report['clock']}) causal: {per_s['causal']:.1f}  documents: {per_s['documents']:.1f}"
          f"  documents_masked: {per_s['documents_masked']:.1f}")
    print(f"documents / causal (tokens/s): {report['ratio']:.3f}")
    print(f"documents / documents_masked (tokens/s): {report['varlen_over_masked']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
