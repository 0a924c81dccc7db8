#!/usr/bin/env python
"""The host cost of dtgpt's Muon step (--optimizer muon) against torch's own Muon, where the math is nil.

    python scripts/bench_muon.py                      # a dense model and an MoE one, the ratios
    python scripts/bench_muon.py --models moe --experts 16 --steps 20 --rounds 5

A GPU optimizer step is bounded below by the host time spent issuing it and by its kernels; at
small widths the host sets the pace (docs/performance.md, CPU proxies). On a CPU, with matrices
so small that the math is nil (12 layers like 124m, hidden 16, 2 heads of one query group, SwiGLU;
the MoE model: 8 experts in every block), the time of a step is that host time, the aten ops it
dispatches stand for the kernels a GPU would launch, and the matrix products (aten::mm, addmm,
bmm, baddbmm: all of them Newton-Schulz's, AdamW has none) for the GEMM kernels among them.

dtgpt: dtgpt.optim.build_optimizer on the one-process model, as the trainer builds it
(MuonWithAdamW: Megatron's matrices, the fused QKV split per query group, SwiGLU's [gate; fc1]
one matrix, an MoE layer's stacked experts one batched iteration; foreach AdamW for the rest).
Reference: torch.optim.Muon (2-D parameters only) for the same matrices as torch holds them,
the QKV whole, gate and fc1 apart and each expert a parameter of its own (megatron-core's
SequentialMLP), beside torch's foreach AdamW for the rest. Both Newton-Schulz iterations run in
bf16 (torch's always does; Megatron's default muon_fp32_matmul_prec "medium"), 5 steps, same
momentum, Nesterov, LR and weight decay. Both sides in one process, the same gradients, interleaved
round by round (ABBA) so load on the machine falls on both alike. Host time per step is the
median over rounds of a round's mean; ops and matrix products are counted by torch.profiler over
one step (every aten:: event, nested ones included, but not those a CPU runs inside a batched
product: a GPU runs one kernel there). Ratios are dtgpt / reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

try:
    import dtgpt  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.config import ModelConfig, OptimizerConfig  # noqa: E402
from dtgpt.model import GPT  # noqa: E402
from dtgpt.muon import EXPERT_MATRICES, is_muon_matrix, muon_matrices  # noqa: E402
from dtgpt.optim import build_optimizer  # noqa: E402
from dtgpt.profiling import count_ops_profile  # noqa: E402

MATRIX_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
"""The GEMM kernels: the leaves matmul dispatches to (aten::matmul itself is not one)."""
LR, WEIGHT_DECAY, MOMENTUM, NS_STEPS = 1e-3, 0.1, 0.9, 5


def build_model(args, experts: int) -> GPT:
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, group_query_attention=True,
                      num_query_groups=1, swiglu=True, ffn_hidden_size=4 * args.hidden, add_bias_linear=False, seq_length=16,
                      max_position_embeddings=16, num_experts=experts or None, moe_ffn_hidden_size=4 * args.hidden)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg, args.vocab)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
            p.grad = torch.randn_like(p)  # a step reads the gradients; nothing zeroes them here
    return model


def dtgpt_optimizer(model: GPT) -> torch.optim.Optimizer:
    cfg = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY, muon_momentum=MOMENTUM, muon_nesterov=True, muon_num_ns_steps=NS_STEPS)
    return build_optimizer(model.named_parameters(), cfg, matrices=muon_matrices(model))


class Reference:
    """torch.optim.Muon over the model's matrices as 2-D parameters (a stacked expert weight: one
    parameter per expert, its slice of the gradient), torch's AdamW over the rest."""

    def __init__(self, model: GPT):
        matrices, rest = [], []
        for name, p in model.named_parameters():
            if name.endswith(EXPERT_MATRICES):
                pieces = list(zip(p.detach(), p.grad))
            else:
                pieces = [(p.detach(), p.grad)]
            for weight, grad in pieces:
                copied = torch.nn.Parameter(weight.clone())
                copied.grad = grad.clone()
                (matrices if is_muon_matrix(name, p) else rest).append(copied)
        self.muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=True, ns_steps=NS_STEPS)
        self.adamw = torch.optim.AdamW(rest, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        self.matrices = len(matrices)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


def in_product(event) -> bool:
    """Whether a matrix product encloses the event: a CPU's batched product runs one addmm_ per
    matrix inside it (select, as_strided...), where a GPU launches one batched GEMM kernel."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in MATRIX_PRODUCTS:
            return True
        parent = parent.cpu_parent
    return False


def ops_of(step: Callable[[], None]) -> dict[str, int]:
    """{"ops": the aten:: events of one step (nested ones too, but not a product's insides),
    "products": its matrix products}."""
    with count_ops_profile() as prof:
        step()
    names = [e.name for e in prof.events() if e.name.startswith("aten::") and not in_product(e)]
    return {"ops": len(names), "products": sum(1 for n in names if n in MATRIX_PRODUCTS)}


def measure(args, experts: int) -> dict:
    """Both sides on the same model and gradients: {side: ms, ops, products} and the ratios."""
    model = build_model(args, experts)
    sides = {"dtgpt": dtgpt_optimizer(model).step, "reference": Reference(model).step}
    for step in sides.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in sorted(sides, reverse=r % 2 == 1):  # ABBA
            start = time.perf_counter()
            for _ in range(args.steps):
                sides[name]()
            times[name].append(1000 * (time.perf_counter() - start) / args.steps)
    result = {name: {"ms": statistics.median(ts), **ops_of(sides[name])} for name, ts in times.items()}
    result["ratio"] = {k: result["dtgpt"][k] / result["reference"][k] for k in ("ms", "ops", "products")}
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="dense,moe", help="comma-separated of dense, moe")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8, help="experts per block of the moe model")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per round and side")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the order alternating")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    for name, least in (("layers", 1), ("hidden", 1), ("heads", 1), ("experts", 2), ("vocab", 1), ("steps", 1), ("rounds", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            p.error(f"--{name}={getattr(args, name)} must be {least} or more")
    if args.hidden % args.heads:
        p.error(f"--hidden={args.hidden} must be a multiple of --heads={args.heads}")
    for model in args.models.split(","):
        if model.strip() not in ("dense", "moe"):
            p.error(f"--models={args.models!r}: {model.strip()!r} is not dense or moe")
    return args


HEADER = f"{'model':<7} {'dtgpt ms':>9} {'ref ms':>9} {'host ratio':>10} {'dtgpt ops':>10} {'ref ops':>9} {'ops ratio':>9} {'dtgpt mm':>9} {'ref mm':>7} {'mm ratio':>8}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    print(f"nil width: {args.layers} layers, hidden {args.hidden}, {args.heads} heads (1 query group), SwiGLU, "
          f"moe: {args.experts} experts per block; Newton-Schulz {NS_STEPS} steps in bf16; torch {torch.__version__}, 1 thread")  # fmt: skip
    print(HEADER)
    for name in (m.strip() for m in args.models.split(",")):
        r = measure(args, args.experts if name == "moe" else 0)
        d, ref, ratio = r["dtgpt"], r["reference"], r["ratio"]
        print(f"{name:<7} {d['ms']:>9.2f} {ref['ms']:>9.2f} {ratio['ms']:>10.2f} {d['ops']:>10} {ref['ops']:>9} {ratio['ops']:>9.2f} "
              f"{d['products']:>9} {ref['products']:>7} {ratio['products']:>8.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
