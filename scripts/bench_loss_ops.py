#!/usr/bin/env python
"""Aten ops of the loss over the vocabulary, dtgpt's against the plain loop's, forward and backward.

    python scripts/bench_loss_ops.py                 # bf16 logits, as Megatron's regime hands them over
    python scripts/bench_loss_ops.py --dtype fp32 --tokens 64 --vocab 512

dtgpt's loss of a micro-batch is `GlobalBatchLoss` over `cross_entropy_sum` (dtgpt/parallel/
model_parts.py): the logits cast to fp32 (Megatron computes the loss in fp32), the sum of token
losses, times loss scale / the global batch's loss tokens. The plain loop's (scripts/reference_gpt.py)
is `F.cross_entropy(logits.float(), labels)`, a mean. Each is run eagerly on the same (tokens,
vocabulary) logits and its aten ops are counted by torch.profiler (nested ones included), forward
and backward together (the loss of a global batch of one micro-batch: built, then called); a GPU
launches a kernel for most of them. The two losses are also checked
equal (dtgpt's with the batch's own token count as denominator). Ratio: dtgpt / plain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import dtgpt  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.parallel.model_parts import GlobalBatchLoss, cross_entropy_sum  # noqa: E402


def plain_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def dtgpt_loss(labels: torch.Tensor):
    """The trainer's loss of a one-micro-batch global batch (training.calculate_per_token_loss, the
    default): GlobalBatchLoss built, then called. The loss tokens are counted outside (the plain
    mean counts them inside nll_loss; dtgpt counts them once per global batch, summed over dp)."""
    denominator = torch.tensor(float(labels.numel()))

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return GlobalBatchLoss(denominator, 1.0, cross_entropy_sum)(logits, labels)

    return loss


def count(loss_fn, logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, float]:
    """(aten ops of forward and backward, the loss)."""
    x = logits.detach().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = loss_fn(x, labels)
        loss.backward()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")), loss.item()


def measure(dtype: torch.dtype, tokens: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, vocab, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    ours = dtgpt_loss(labels)
    for fn in (plain_loss, ours):  # warm-up: first calls dispatch extra ops
        count(fn, logits, labels)
    (plain_ops, plain_value), (ours_ops, ours_value) = count(plain_loss, logits, labels), count(ours, logits, labels)
    return {"plain": plain_ops, "dtgpt": ours_ops, "ratio": ours_ops / plain_ops, "difference": abs(ours_value - plain_value)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="the logits' dtype")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    r = measure(dtype, args.tokens, args.vocab)
    print(f"loss over {args.tokens} tokens x {args.vocab} vocabulary, {args.dtype} logits, forward + backward")
    print(f"aten ops: dtgpt {r['dtgpt']}, plain {r['plain']}, ratio {r['ratio']:.2f}; |loss difference| {r['difference']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
