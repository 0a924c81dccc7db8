#!/usr/bin/env python
"""Time the MoE experts' grouped GEMM against their for-loop path (dtgpt.moe.experts.GroupedExperts),
alone or inside a whole MoE layer (dtgpt.moe.layer.MoELayer: router, dispatch, experts, combine).

    python scripts/bench_moe.py                                  # CPU: DeepSeek-like experts, scaled down
    python scripts/bench_moe.py --layer                          # the same shape as a whole MoE layer
    python scripts/bench_moe.py --device cuda --dtype bf16       # CUDA: DeepSeek-V3's MoE layer shape
    python scripts/bench_moe.py --experts 8 --topk 2 --hidden 512 --ffn 1408 --tokens 2048   # Mixtral-like
    python scripts/bench_moe.py --tokens 64 --hidden 32 --ffn 48 --iters 2 --json out.json

One forward + backward of the experts per iteration, on tokens already routed (top-k of random
logits, sorted by expert as a dispatcher hands them over), the same inputs and weights for both
paths; with --layer, one forward + backward of a whole MoE layer on unrouted tokens (its router
draws the routing). Before timing, both paths run once on the same input and the largest difference of their
outputs and gradients is reported (fp32: zero, the loop is the grouped path's oracle). The two are
timed alternately, round by round in ABBA order, after untimed warm-up iterations. Tokens/s
counts tokens before the top-k fan-out (a layer's throughput), and the line
`grouped / loop (tokens/s): R` gives the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

try:
    import dtgpt  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.config import ModelConfig
from dtgpt.moe.experts import GroupedExperts
from dtgpt.moe.layer import MoELayer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (tokens, experts, topk, hidden, ffn): DeepSeek-V3's fine-grained experts (256 of width 2048, top-8,
# hidden 7168) on a GPU; on a CPU 64 of them with hidden and tokens scaled down to run in a minute.
DEFAULTS = {"cpu": (64, 64, 8, 64, 2048), "cuda": (16384, 256, 8, 7168, 2048)}


def build(args, grouped: bool, device: torch.device) -> GroupedExperts:
    experts = GroupedExperts(args.experts, args.hidden, args.ffn, swiglu=True, bias=False, grouped_gemm=grouped,
                             init_std=0.02, output_init_std=0.02 / (2 * 24) ** 0.5)  # fmt: skip
    experts.init_weights(seed=0, device=device)
    return experts.to(device=device, dtype=DTYPES[args.dtype])


def build_layer(args, grouped: bool, device: torch.device) -> MoELayer:
    """A whole MoE layer (top-k softmax router with the load-balancing loss, SwiGLU experts)."""
    cfg = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1, ffn_hidden_size=args.ffn,
                      swiglu=True, add_bias_linear=False, num_experts=args.experts, moe_router_topk=args.topk,
                      moe_ffn_hidden_size=args.ffn, moe_aux_loss_coeff=1e-2, moe_grouped_gemm=grouped)  # fmt: skip
    layer = MoELayer(cfg)
    layer.experts.init_weights(seed=0, device="cpu")
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    return layer.to(device=device, dtype=DTYPES[args.dtype])


def layer_step(layer: MoELayer, x: torch.Tensor, _counts, grad: torch.Tensor):
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(grad)
    return y, x.grad


def routed_inputs(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_sorted (tokens * topk, hidden), tokens_per_expert (experts,)) of a random top-k routing."""
    g = torch.Generator().manual_seed(1)
    choice = torch.randn(args.tokens, args.experts, generator=g).topk(args.topk, dim=-1).indices.flatten()
    counts = torch.bincount(choice, minlength=args.experts)
    x = torch.randn(choice.numel(), args.hidden, generator=g)
    return x.to(device=device, dtype=DTYPES[args.dtype]), counts.to(device)


def step(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    y = experts(x, counts)
    y.backward(grad)
    return y, x.grad


def compare(grouped, loop, x, counts, grad, run=step) -> float:
    """The largest absolute difference of the two paths' output and gradients (x and weights)."""
    results = [run(m, x, counts, grad) for m in (grouped, loop)]
    diffs = [(a - b).abs().max().item() for a, b in zip(*results)]
    diffs += [(grouped.get_parameter(n).grad - p.grad).abs().max().item() for n, p in loop.named_parameters()]
    return max(diffs)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iters(experts, x, counts, grad, warmup: int, iters: int, device: torch.device, run=step) -> list[float]:
    for _ in range(warmup):
        run(experts, x, counts, grad)
    synchronize(device)
    ms = []
    for _ in range(iters):
        start = time.perf_counter()
        run(experts, x, counts, grad)
        synchronize(device)
        ms.append(1000 * (time.perf_counter() - start))
    return ms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GroupedExperts: grouped GEMM vs the for-loop path, forward + backward")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    for name in ("tokens", "experts", "topk", "hidden", "ffn"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"default: {dict(cpu=DEFAULTS['cpu'], cuda=DEFAULTS['cuda'])}")
    p.add_argument("--layer", action="store_true", help="time a whole MoE layer (router, dispatch, experts, combine)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="timed iterations per round")
    p.add_argument("--rounds", type=int, default=2, help="measurements per path, alternating their order")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    for name, default in zip(("tokens", "experts", "topk", "hidden", "ffn"), DEFAULTS[args.device]):
        if getattr(args, name) is None:
            setattr(args, name, default)
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} must be at most --experts {args.experts}")
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--iters and --rounds must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
    }
    shape = {k: getattr(args, k) for k in ("tokens", "experts", "topk", "hidden", "ffn", "dtype")}
    what = "MoE layer (router, dispatch, SwiGLU experts, combine)" if args.layer else "SwiGLU experts"
    print(f"dtgpt MoE {'layer' if args.layer else 'experts'} benchmark | {env['date']} | {env['device']} | torch {env['torch']}")
    print(f"{what}, forward + backward: {shape}; {args.warmup} warm-up + {args.iters} timed iterations "
          f"x {args.rounds} rounds per path (alternating order)", flush=True)  # fmt: skip
    if args.layer:
        paths = {"grouped": build_layer(args, True, device), "loop": build_layer(args, False, device)}
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, args.tokens, args.hidden, generator=gen).to(device=device, dtype=DTYPES[args.dtype])
        counts, run = torch.zeros(args.experts, dtype=torch.long), layer_step
    else:
        paths = {"grouped": build(args, True, device), "loop": build(args, False, device)}
        (x, counts), run = routed_inputs(args, device), step
    grad = torch.randn_like(x)
    max_diff = compare(paths["grouped"], paths["loop"], x, counts, grad, run)
    print(f"largest difference of output and gradients, grouped vs loop: {max_diff:.3g}", flush=True)
    ms: dict[str, list[float]] = {"grouped": [], "loop": []}
    for r in range(args.rounds):
        for name in ("grouped", "loop") if r % 2 == 0 else ("loop", "grouped"):
            ms[name] += time_iters(paths[name], x, counts, grad, args.warmup, args.iters, device, run)
    results = {}
    for name, times in ms.items():
        tokens_per_s = args.tokens * len(times) / (sum(times) / 1000)
        results[name] = {"tokens_per_s": tokens_per_s, "ms_per_iter": sum(times) / len(times), "iter_ms": times}
        print(f"  {name:<8} {tokens_per_s:>14,.0f} tokens/s {results[name]['ms_per_iter']:>10.2f} ms/iter")
    ratio = results["grouped"]["tokens_per_s"] / results["loop"]["tokens_per_s"]
    print(f"grouped / loop (tokens/s): {ratio:.3f}", flush=True)
    if args.json:
        report = {"environment": env, "shape": shape, "layer": args.layer, "max_abs_diff": max_diff, "results": results,
                  "ratio": ratio, "tokens_per_expert": None if args.layer else counts.tolist()}  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
