#!/usr/bin/env python
"""The host cost per layer of dtgpt's training step on dp2, tp2 and pp2, against a plain loop.

    python scripts/bench_host_mesh.py                          # bf16, dp2,tp2,pp2, 2 and 6 layers
    python scripts/bench_host_mesh.py --layouts tp2 --layers 2,4,8 --precision fp32
    python scripts/bench_host_mesh.py --layouts dp2 --layers 2,4 --by-name 40   # which ops differ

The one-process measurement (scripts/bench_host.py) at nil width, on a mesh: the script launches
itself under torchrun on 2 gloo ranks, and each rank builds dtgpt's step (`train_step`, as the
trainer runs it) for each layout and layer count, and beside it a plain reference, interleaved
round by round (ABBA) in the same processes. Width is nil (hidden 16, 2 heads, seq 16,
micro-batch 1 per rank, vocabulary 256), so a step's time is the host's. Measuring at several
layer counts separates the cost per layer (the slope of a least-squares line through the
points) from the fixed cost of a step (its intercept: the loss, the optimizer's launch, the
collectives of the step).

References, the code one would write by hand on the same ranks:
- dp2: the plain loop of scripts/bench.py around `DistributedDataParallel` (gradients averaged
  over the two ranks in one bucket), bf16 autocast, foreach AdamW, clipping;
- tp2 and pp2: the plain loop on each rank over the whole model (no hand-written tp or pp: a rank
  of either holds less of the model than that loop, pp half its layers, so a ratio of 1 per layer
  is no bound from below, just the plain loop's cost).

Aten ops per step are counted by torch.profiler over one step on rank 0 (nested ops included, so
DTensor's and FSDP's work on local tensors counts). Host times are rank 0's (every rank waits for
its peer in the collectives). Ratios are dtgpt / reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (scripts/bench.py: both sides' steps)
import bench_host  # noqa: E402

from dtgpt.api import build_model, build_train_state, train_step  # noqa: E402
from dtgpt.config import validate  # noqa: E402
from dtgpt.distributed import init_distributed, shutdown  # noqa: E402
from dtgpt.profiling import count_ops_profile  # noqa: E402

WORLD = 2
LAYOUTS = {  # name: (tensor, pipeline, data-parallel shard) sizes
    "dp2": (1, 1, 2),
    "tp2": (2, 1, 1),
    "pp2": (1, 2, 1),
}
RESULT = "bench_host_mesh result: "


def mesh_config(layout: str, layers: int, precision: str, vocab: int):
    tp, pp, dp = LAYOUTS[layout]
    bench.SIZES["nil_mesh"] = (layers, *bench_host.NIL[1:])
    bench.VOCAB_SIZE = vocab
    cfg = bench.bench_config("nil_mesh", "cpu", bf16=precision == "bf16")
    cfg.model.make_vocab_size_divisible_by = 1
    cfg.training.global_batch_size = cfg.training.micro_batch_size * dp
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_shard_size = tp, pp, dp
    validate(cfg, world_size=WORLD)
    return cfg


def ddp_reference_step(cfg, device):
    """scripts/bench.py's plain step with its model wrapped in DistributedDataParallel."""
    from torch.nn.parallel import DistributedDataParallel

    return bench.reference_step(cfg, device, wrap=DistributedDataParallel)[0]


def worker(args) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    runtime = None
    results = []
    for layout in args.layouts.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            cfg = mesh_config(layout, layers, args.precision, args.vocab)
            if runtime is None:
                runtime = init_distributed(cfg)
            torch.manual_seed(cfg.training.seed)
            state = build_train_state(cfg, build_model(cfg, runtime, args.vocab))
            ref_cfg = mesh_config(layout, layers, args.precision, args.vocab)
            ref_cfg.training.global_batch_size = ref_cfg.training.micro_batch_size
            sides = {
                "dtgpt": lambda b, cfg=cfg, state=state: train_step(cfg, state, b),
                "plain": ddp_reference_step(ref_cfg, device) if layout.startswith("dp") else bench.reference_step(ref_cfg, device)[0],
            }
            batches = bench.make_batches(ref_cfg, device, 4, on_host=False)
            for step in sides.values():
                for i in range(args.warmup):
                    step(batches[i % len(batches)])
            times: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.rounds):
                for name in sorted(sides, reverse=r % 2 == 1):  # ABBA
                    torch.distributed.barrier()
                    start = time.perf_counter()
                    for i in range(args.steps):
                        sides[name](batches[i % len(batches)])
                    times[name].append(1000 * (time.perf_counter() - start) / args.steps)
            row = {"layout": layout, "layers": layers}
            for name, step in sides.items():
                names = aten_op_names(step, batches[0])
                row[name] = {"ms": statistics.median(times[name]), "ops": sum(names.values())}
                if args.by_name:
                    row[name]["names"] = dict(names)
            results.append(row)
            del state, sides
    if runtime.rank == 0:
        print(RESULT + json.dumps(results), flush=True)
    shutdown(clean=True)


def aten_op_names(step, batch: torch.Tensor) -> Counter:
    """The aten ops of one step by name (bench_host.aten_ops counts the same events)."""
    with count_ops_profile() as prof:
        step(batch)
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def slope(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (per layer, fixed) of value against layers."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    per = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return per, my - per * mx


def summarize(rows: list[dict]) -> dict:
    """Per layout: per-layer slope and fixed cost of ms and ops for both sides, and the ratios."""
    out = {}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        s = {}
        for side in ("dtgpt", "plain"):
            for k in ("ms", "ops"):
                s[f"{side}_{k}_per_layer"], s[f"{side}_{k}_fixed"] = slope([(r["layers"], r[side][k]) for r in mine])
        for k in ("ms", "ops"):
            s[f"{k}_per_layer_ratio"] = s[f"dtgpt_{k}_per_layer"] / s[f"plain_{k}_per_layer"]
            s[f"{k}_fixed_ratio"] = s[f"dtgpt_{k}_fixed"] / s[f"plain_{k}_fixed"]
        out[layout] = s
    return out


def by_name(rows: list[dict], layout: str) -> list[tuple[str, float, float, float, float]]:
    """Per aten op of `layout`: (name, dtgpt per layer, plain per layer, dtgpt fixed, plain fixed),
    the ops where the two sides differ most first (rows measured with --by-name)."""
    mine = [r for r in rows if r["layout"] == layout]
    names = sorted({n for r in mine for side in ("dtgpt", "plain") for n in r[side]["names"]})
    out = []
    for n in names:
        fits = [slope([(r["layers"], r[side]["names"].get(n, 0)) for r in mine]) for side in ("dtgpt", "plain")]
        out.append((n, fits[0][0], fits[1][0], fits[0][1], fits[1][1]))
    return sorted(out, key=lambda t: -(abs(t[1] - t[2]) * 8 + abs(t[3] - t[4])))


def print_by_name(rows: list[dict], top: int) -> None:
    for layout in dict.fromkeys(r["layout"] for r in rows):
        print(f"\n{layout} by aten op (dtgpt / plain), the largest differences first:")
        print(f"{'op':<40} {'per layer':>15} {'fixed':>15}")
        for n, dl, pl, df, pf in by_name(rows, layout)[:top]:
            if round(dl - pl, 1) or round(df - pf, 1):
                print(f"{n:<40} {dl:>7.1f}/{pl:<7.1f} {df:>7.1f}/{pf:<7.1f}")


def launch(args) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", __file__, "--worker"]
    for key in ("layouts", "layers", "precision", "steps", "rounds", "warmup", "vocab"):
        cmd += [f"--{key}", str(getattr(args, key))]
    cmd += ["--by-name", str(args.by_name)] if args.by_name else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    sys.stderr.write(proc.stdout)
    raise SystemExit(f"error: the {WORLD}-rank measurement exited with {proc.returncode} and printed no result")


def print_table(rows: list[dict], summary: dict) -> None:
    print(f"{'layout':<7} {'layers':>6} {'dtgpt ms':>9} {'plain ms':>9} {'dtgpt ops':>10} {'plain ops':>10}")
    for r in rows:
        d, p = r["dtgpt"], r["plain"]
        print(f"{r['layout']:<7} {r['layers']:>6} {d['ms']:>9.2f} {p['ms']:>9.2f} {d['ops']:>10} {p['ops']:>10}")
    print("\nper layer (slope) and fixed (intercept), dtgpt / plain:")
    print(f"{'layout':<7} {'ms/layer':>15} {'ratio':>6} {'ops/layer':>13} {'ratio':>6} {'fixed ms':>15} {'ratio':>6} {'fixed ops':>13} {'ratio':>6}")
    for layout, s in summary.items():
        print(f"{layout:<7} {s['dtgpt_ms_per_layer']:>7.2f}/{s['plain_ms_per_layer']:<7.2f} {s['ms_per_layer_ratio']:>6.2f} "
              f"{s['dtgpt_ops_per_layer']:>6.0f}/{s['plain_ops_per_layer']:<6.0f} {s['ops_per_layer_ratio']:>6.2f} "
              f"{s['dtgpt_ms_fixed']:>7.1f}/{s['plain_ms_fixed']:<7.1f} {s['ms_fixed_ratio']:>6.2f} "
              f"{s['dtgpt_ops_fixed']:>6.0f}/{s['plain_ops_fixed']:<6.0f} {s['ops_fixed_ratio']:>6.2f}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="dp2,tp2,pp2", help=f"comma-separated of {', '.join(LAYOUTS)}")
    p.add_argument("--layers", default="2,6", help="comma-separated layer counts (even: pp2 splits them)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--steps", type=int, default=10, help="steps per round and side")
    p.add_argument("--rounds", type=int, default=4, help="rounds, the order alternating")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (small: the math stays nil)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds for the whole launch")
    p.add_argument("--by-name", type=int, default=0, metavar="N",
                   help="also print the N aten ops whose counts differ most between the sides, per layer and fixed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            p.error(f"--layouts={layout!r} must be one of {', '.join(LAYOUTS)}")
    bench_host.check_counts(p, args)
    if args.timeout < 1 or args.by_name < 0:
        p.error(f"--timeout={args.timeout} must be 1 or more and --by-name={args.by_name} 0 or more")
    try:
        layers = [int(n) for n in args.layers.split(",")]
    except ValueError:
        layers = []
    if len(set(layers)) < 2 or any(n < 2 or n % 2 for n in layers):
        p.error(f"--layers={args.layers!r} needs two or more distinct even counts (pp2 halves them)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    print(f"nil width on {WORLD} gloo ranks: hidden {bench_host.NIL[1]}, {bench_host.NIL[2]} heads, seq {bench_host.NIL[3]}, "
          f"micro-batch 1 per rank, vocab {args.vocab}, {args.precision}; torch {torch.__version__}, 1 thread per rank")  # fmt: skip
    rows = launch(args)
    print_table(rows, summarize(rows))
    if args.by_name:
        print_by_name(rows, args.by_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
