#!/usr/bin/env python
"""Time dtgpt's training step against a plain single-file PyTorch GPT with the same math.

    python scripts/bench.py --sizes 124m,350m,1.3b,2.7b          # on an H100 (see docs/performance.md)
    python scripts/bench.py --sizes tiny --device cpu --iters 3   # a smoke run on a CPU
    python scripts/bench.py --sizes 1.3b --json results.json

dtgpt runs exactly as the trainer runs it on one device: a Config, `init_distributed` (in bf16
the model computes in bf16 over fp32 master weights, Megatron's regime: in one process a bf16
copy of the masters, dtgpt/parallel/compute_copy.py), the library's `build_model` (meta build -> parallelize -> materialise) and
`build_train_state` (AdamW, LR schedule, loss scaler), then `train_step` once per iteration with
one micro-batch. The reference is what one would write in a single file: the model of
scripts/reference_gpt.py (pre-LN GPT, learned positions, fused QKV, tanh-GeLU MLP, biases, final
LayerNorm, tied head) and the step below: bf16 autocast, `torch.compile` of the model (loss
included), AdamW (fused on CUDA), clipping at 1.0, and the loss read on the host once per
iteration as a loop that logs every iteration does.

The two are measured one after the other, never both in memory, alternating their order round by
round (ABBA) so that drift in clocks or temperature falls on both alike. Warm-up iterations
(compilation included) are not timed. Throughput uses one FLOP count for both
(`dtgpt.model.flops_per_token`, Megatron's formula); MFU is against `dtgpt.metrics.peak_tflops`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

try:
    import dtgpt  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.config import Config, validate
from dtgpt.distributed import init_distributed, resolve_device, shutdown
from dtgpt.metrics import peak_tflops
from dtgpt.config import padded_vocab_size
from dtgpt.model import GPT
from dtgpt.model_size import flops_per_token, num_parameters
from dtgpt.api import build_model, build_train_state, train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also when loaded by path
from bench_profile import print_profiles, profile_steps  # noqa: E402
from reference_gpt import ReferenceGPT  # noqa: E402

# name: (layers, hidden, heads, seq_length, micro_batch_size)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 64, 4, 64, 4),
    "124m": (12, 768, 12, 1024, 16),
    "350m": (24, 1024, 16, 1024, 16),
    "1.3b": (24, 2048, 16, 2048, 4),
    "2.7b": (32, 2560, 32, 2048, 2),
}
GPU_SIZES = "124m,350m,1.3b,2.7b"
VOCAB_SIZE = 50257  # GPT-2's BPE; padded to a multiple of 128
# The same optimizer settings on both sides (the lr is constant: no schedule to differ).
LR, BETAS, EPS, WEIGHT_DECAY, CLIP_GRAD = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
FLOP_FORMULA = (
    "FLOPs/token = dtgpt.model.flops_per_token = Megatron-LM's num_floating_point_operations / tokens "
    "= 72*L*h^2*(1 + s/(6h) + V/(12*L*h)) for a 4h MLP (fwd+bwd, attention without causal discount, "
    "V = padded vocab, recomputation not counted)"
)
_GIB = float(2**30)

Step = Callable[[torch.Tensor], float]


# ---------------------------------------------------------------------------------------------
# dtgpt, as the trainer runs it


def bench_config(size: str, device_type: str, *, bf16: bool = True, compile: bool = False) -> Config:
    """The trainer's Config for one benchmark size: one micro-batch per step, no dropout."""
    layers, hidden, heads, seq, micro = SIZES[size]
    cfg = Config()
    m, t, o, d = cfg.model, cfg.training, cfg.optimizer, cfg.data
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = layers, hidden, heads, seq
    m.hidden_dropout = m.attention_dropout = 0.0
    m.make_vocab_size_divisible_by = 128
    t.micro_batch_size = t.global_batch_size = micro
    t.bf16, t.compile, t.device, t.train_iters = bf16, compile, device_type, 1_000_000
    o.lr, o.lr_decay_style, o.clip_grad = LR, "constant", CLIP_GRAD
    o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay = *BETAS, EPS, WEIGHT_DECAY
    d.mock_data, d.tokenizer_type, d.vocab_size, d.num_workers = True, "NullTokenizer", VOCAB_SIZE, 0
    validate(cfg, world_size=1)
    return cfg


def build_dtgpt(cfg: Config, device: torch.device):
    """The TrainState (model parts, optimizer, LR schedule, scaler) of the trainer's own setup path."""
    torch.manual_seed(cfg.training.seed)
    runtime = init_distributed(cfg)
    return build_train_state(cfg, build_model(cfg, runtime, VOCAB_SIZE))


def dtgpt_step(cfg: Config, device: torch.device) -> tuple[Step, GPT]:
    """One trainer iteration (train_step: lr, forward-backward, clip, AdamW, schedule), and the model it trains."""
    state = build_dtgpt(cfg, device)

    def step(batch: torch.Tensor) -> float:
        return train_step(cfg, state, batch).loss

    return step, state.model.parts[0]


# ---------------------------------------------------------------------------------------------
# The plain reference's training step (its model: scripts/reference_gpt.py)


def reference_step(cfg: Config, device: torch.device, wrap: Callable | None = None) -> tuple[Step, ReferenceGPT]:
    """A plain training iteration of the reference, and the (uncompiled) model it trains;
    `wrap` (e.g. DistributedDataParallel) wraps the model the step calls."""
    torch.manual_seed(cfg.training.seed)
    m = cfg.model
    vocab = padded_vocab_size(VOCAB_SIZE, m.make_vocab_size_divisible_by)
    model = ReferenceGPT(m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, vocab, m.norm_epsilon)
    model.to(device)
    params = list(model.parameters())  # the tied weight appears once
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=fused, foreach=not fused)
    run = torch.compile(model) if cfg.training.compile else model
    run = wrap(run) if wrap is not None else run
    dtype = torch.bfloat16 if cfg.training.bf16 else None

    def step(batch: torch.Tensor) -> float:
        batch = batch.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = run(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD, foreach=True)
        optimizer.step()
        return loss.item()

    return step, model


# ---------------------------------------------------------------------------------------------
# Measuring


def make_batches(cfg: Config, device: torch.device, count: int, on_host: bool) -> list[torch.Tensor]:
    """Random (B, T+1) token batches, the same for both sides; pinned host memory if on_host."""
    g = torch.Generator().manual_seed(0)
    shape = (cfg.training.micro_batch_size, cfg.model.seq_length + 1)
    batches = [torch.randint(0, VOCAB_SIZE, shape, generator=g) for _ in range(count)]
    if on_host:
        return [b.pin_memory() for b in batches] if device.type == "cuda" else batches
    return [b.to(device) for b in batches]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    torch._dynamo.reset()  # compiled graphs hold on to the model they were traced from
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(step: Step, batches: list[torch.Tensor], warmup: int, iters: int, device: torch.device):
    """(milliseconds per timed iteration, losses): CUDA events on CUDA, perf_counter elsewhere."""
    cuda = device.type == "cuda"

    def mark():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    for i in range(warmup):
        step(batches[i % len(batches)])
    synchronize(device)
    marks, losses = [mark()], []
    for i in range(iters):
        losses.append(step(batches[(warmup + i) % len(batches)]))
        marks.append(mark())
    synchronize(device)
    ms = [a.elapsed_time(b) if cuda else 1000 * (b - a) for a, b in zip(marks, marks[1:])]
    return ms, losses


def measure(impl: str, cfg: Config, device: torch.device, batches, warmup: int, iters: int, profile: bool = False) -> dict:
    """Build one side, warm it up, time it (and profile it), free it; errors are recorded, not raised."""
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    build = dtgpt_step if impl == "dtgpt" else reference_step
    try:
        step = build(cfg, device)[0]
        ms, losses = time_steps(step, batches, warmup, iters, device)
        result = {"iter_ms": ms, "losses": losses}
        if profile:  # after the timed steps, so the profiler costs them nothing
            result["profile"] = profile_steps(step, batches, device)
    except Exception as e:  # an OOM at one size should not lose the others
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"[:500]}
    step = None  # noqa: F841 - drop the model and optimizer before the next measurement
    if device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
    free_memory(device)
    return result


def summarize(runs: list[dict], tokens_per_iter: int, fpt: float, peak: float | None) -> dict:
    """Time-weighted over every timed iteration of every round."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    ms = [t for r in runs for t in r["iter_ms"]]
    tokens_per_s = tokens_per_iter * len(ms) / (sum(ms) / 1000)
    tflops = fpt * tokens_per_s / 1e12
    mems = [r["peak_mem_gib"] for r in runs if "peak_mem_gib" in r]
    return {
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "ms_per_iter": sum(ms) / len(ms),
        "ms_median": sorted(ms)[len(ms) // 2],
        "peak_mem_gib": max(mems) if mems else None,
        "iter_ms": [r["iter_ms"] for r in runs],
        "last_loss": runs[-1]["losses"][-1],
        "profile": runs[-1].get("profile"),
    }


def bench_size(size: str, device: torch.device, args, peak: float | None) -> dict:
    cfg = bench_config(size, device.type, compile=args.compile)
    m, mb = cfg.model, cfg.training.micro_batch_size
    vocab = padded_vocab_size(VOCAB_SIZE, m.make_vocab_size_divisible_by)
    fpt = flops_per_token(m, vocab)
    tokens = mb * m.seq_length
    params = num_parameters(m, vocab)
    print(f"\n{size}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, "
          f"micro batch {mb} ({tokens:,} tokens/iter), vocab {vocab:,} (padded), {params / 1e6:.1f}M params, "
          f"{fpt / 1e9:.2f} GFLOP/token", flush=True)  # fmt: skip
    batches = make_batches(cfg, device, 4, args.host_batches)
    runs: dict[str, list[dict]] = {"dtgpt": [], "reference": []}
    for r in range(args.rounds):
        order = ("dtgpt", "reference") if r % 2 == 0 else ("reference", "dtgpt")
        for impl in order:
            # the profile once per side, in the last round: its numbers do not drift, its time is the budget's
            profile = args.profile and r == args.rounds - 1
            runs[impl].append(measure(impl, cfg, device, batches, args.warmup, args.iters, profile))
            if "error" in runs[impl][-1]:
                print(f"  {impl} round {r + 1}: {runs[impl][-1]['error']}", flush=True)
    result = {
        "config": {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
                   "seq_length": m.seq_length, "micro_batch_size": mb, "padded_vocab_size": vocab, "parameters": params},
        "tokens_per_iter": tokens,
        "flops_per_token": fpt,
        "dtgpt": summarize(runs["dtgpt"], tokens, fpt, peak),
        "reference": summarize(runs["reference"], tokens, fpt, peak),
    }  # fmt: skip
    d, ref = result["dtgpt"], result["reference"]
    result["ratio"] = d["tokens_per_s"] / ref["tokens_per_s"] if "error" not in d and "error" not in ref else None
    print_size(result)
    return result


# ---------------------------------------------------------------------------------------------
# Reporting


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _mfu(result: dict) -> str:
    return "-" if result.get("mfu") is None else f"{100 * result['mfu']:.1f}%"


def print_size(result: dict) -> None:
    print(f"  {'impl':<10} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'ms/iter':>9} {'peak GiB':>9}")
    for impl in ("dtgpt", "reference"):
        r = result[impl]
        if "error" in r:
            print(f"  {impl:<10} failed: {r['error']}")
            continue
        print(f"  {impl:<10} {r['tokens_per_s']:>12,.0f} {r['tflops']:>9.3g} {_mfu(r):>7} "
              f"{r['ms_per_iter']:>9.2f} {_fmt(r['peak_mem_gib'], '9.2f'):>9}")  # fmt: skip
    print(f"  dtgpt / reference (tokens/s): {_fmt(result['ratio'], '.3f')}", flush=True)
    print_profiles(result)


def print_summary(results: dict) -> None:
    print(f"\n{'size':<6} {'dtgpt tok/s':>12} {'ref tok/s':>12} {'ratio':>6} {'dtgpt MFU':>10} {'ref MFU':>8}")
    for size, res in results.items():
        d, r = res["dtgpt"], res["reference"]
        print(f"{size:<6} {_fmt(d.get('tokens_per_s'), ',.0f'):>12} {_fmt(r.get('tokens_per_s'), ',.0f'):>12} "
              f"{_fmt(res['ratio'], '.3f'):>6} {_mfu(d):>10} {_mfu(r):>8}")  # fmt: skip


def environment(device: torch.device, peak: float | None) -> dict:
    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()}, "
                                                                   f"{torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "peak_tflops": peak,
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="dtgpt's training step vs a plain PyTorch GPT")
    p.add_argument("--sizes", default=None, help=f"comma-separated of {', '.join(SIZES)} "
                   f"(default: {GPU_SIZES} on CUDA, tiny on CPU)")  # fmt: skip
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile both sides (default: on for CUDA, off for CPU)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (default: 10 on CUDA, 3 on CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per round (default: 20 on CUDA, 5 on CPU)")
    p.add_argument("--rounds", type=int, default=2, help="measurements per side, alternating their order")
    p.add_argument("--host-batches", action="store_true",
                   help="keep batches in pinned host memory: each step includes its host-to-device copy")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=0.0, help="dense peak per device for MFU (0: dtgpt's table)")
    p.add_argument("--profile", action="store_true",
                   help="also profile a few steps per side: kernels per step, GPU busy fraction, optimizer time "
                        "(scripts/bench_profile.py; on a CPU: aten ops and the optimizer's host time)")  # fmt: skip
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if cuda else "cpu"
    args.sizes = [s.strip() for s in (args.sizes or (GPU_SIZES if cuda else "tiny")).split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    args.compile = cuda if args.compile is None else args.compile
    args.warmup = (10 if cuda else 3) if args.warmup is None else args.warmup
    args.iters = (20 if cuda else 5) if args.iters is None else args.iters
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--iters and --rounds must be >= 1 and --warmup >= 0")
    return args


def write_json(args: argparse.Namespace, env: dict, results: dict, complete: bool) -> None:
    if not args.json:
        return
    settings = {k: getattr(args, k) for k in ("device", "compile", "warmup", "iters", "rounds", "host_batches", "profile")}
    report = {"environment": env, "flop_formula": FLOP_FORMULA, "settings": settings, "complete": complete,
              "sizes": args.sizes, "results": results}  # fmt: skip
    tmp = Path(args.json + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.json)  # whole or absent, never half-written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device, 0)
    peak = peak_tflops(device, args.peak_tflops)
    env = environment(device, peak)
    print(f"dtgpt benchmark | {env['date']} | {env['device']} | torch {env['torch']}"
          + (f" | CUDA {env['cuda']}" if env["cuda"] else "") + f" | peak {_fmt(peak, 'g', 'n/a')} TFLOP/s")  # fmt: skip
    print(FLOP_FORMULA)
    print(f"bf16 (dtgpt: Megatron's regime; reference: autocast), compile {'on' if args.compile else 'off'}, {args.warmup} warm-up + {args.iters} timed "
          f"iterations x {args.rounds} rounds per side (alternating order), batches "
          f"{'in pinned host memory' if args.host_batches else 'already on the device'}", flush=True)  # fmt: skip
    results: dict[str, dict] = {}
    try:
        for size in args.sizes:  # the JSON after each size: a run stopped from outside keeps the sizes it finished
            results[size] = bench_size(size, device, args, peak)
            write_json(args, env, results, complete=len(results) == len(args.sizes))
    finally:
        shutdown(clean=False)
    print_summary(results)
    if args.json:
        print(f"\nwrote {args.json}")
    return 0 if all(res["ratio"] is not None for res in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
