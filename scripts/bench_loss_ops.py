#!/usr/bin/env python
"""Aten ops of the loss over the vocabulary, dtgpt's against the plain loop's, forward and backward.

    python scripts/bench_loss_ops.py                 # bf16 logits, as Megatron's regime hands them over
    python scripts/bench_loss_ops.py --dtype fp32 --tokens 64 --vocab 512
    python scripts/bench_loss_ops.py --tp 2          # loss parallelism on 2 gloo ranks
    python scripts/bench_loss_ops.py --tp 2 --torch-loss-parallel   # torch's loss_parallel() instead

dtgpt's loss of a micro-batch is `GlobalBatchLoss` over `cross_entropy_sum` (dtgpt/parallel/
model_parts.py): the logits cast to fp32 (Megatron computes the loss in fp32), the sum of token
losses, times loss scale / the global batch's loss tokens. The plain loop's (scripts/reference_gpt.py)
is `F.cross_entropy(logits.float(), labels)`, a mean. Each is run eagerly on the same (tokens,
vocabulary) logits and its aten ops are counted by torch.profiler (nested ones included), forward
and backward together (the loss of a global batch of one micro-batch: built, then called); a GPU
launches a kernel for most of them. The two losses are also checked
equal (dtgpt's with the batch's own token count as denominator). Ratio: dtgpt / plain.

With --tp 2 the script launches itself on 2 gloo ranks and dtgpt's side is the loss as tensor
parallelism runs it (parallel.loss_parallel, the default): the logits a DTensor sharded over the
vocabulary, as the column-parallel head leaves them, and GlobalBatchLoss over dtgpt's
vocabulary-parallel cross-entropy (dtgpt/parallel/vocab_parallel_loss.py: Megatron's algorithm on
each rank's block, the maxima and sums all-reduced). `--torch-loss-parallel` counts torch's
`loss_parallel()` on the same logits instead (what dtgpt ran before). The plain loop's is the
one-process loss on the whole logits. Counted on rank 0, with the host syncs (`aten::item`,
`aten::_local_scalar_dense`) among dtgpt's ops.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import dtgpt  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.parallel.model_parts import GlobalBatchLoss, cross_entropy_sum  # noqa: E402
from dtgpt.parallel.vocab_parallel_loss import vocab_parallel_cross_entropy_sum  # noqa: E402
from dtgpt.profiling import count_ops_profile  # noqa: E402


def plain_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def dtgpt_loss(labels: torch.Tensor, cross_entropy=cross_entropy_sum):
    """The trainer's loss of a one-micro-batch global batch (training.calculate_per_token_loss, the
    default): GlobalBatchLoss built, then called. The loss tokens are counted outside (the plain
    mean counts them inside nll_loss; dtgpt counts them once per global batch, summed over dp)."""
    denominator = torch.tensor(float(labels.numel()))

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return GlobalBatchLoss(denominator, 1.0, cross_entropy)(logits, labels)

    return loss


HOST_SYNCS = ("aten::item", "aten::_local_scalar_dense")


def count(loss_fn, logits: torch.Tensor, labels: torch.Tensor, context=contextlib.nullcontext) -> tuple[int, int, float]:
    """(aten ops of forward and backward, host syncs among them, the loss)."""
    x = logits.detach().requires_grad_()
    with count_ops_profile() as prof, context():
        loss = loss_fn(x, labels)
        loss.backward()
    value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    return len(names), sum(1 for n in names if n in HOST_SYNCS), value.item()


def measure(dtype: torch.dtype, tokens: int, vocab: int, mesh=None, torch_loss_parallel: bool = False) -> dict:
    """`mesh`: a tp mesh, on which dtgpt's side is the vocabulary-parallel loss, or with
    `torch_loss_parallel` torch's loss_parallel() (module doc)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, vocab, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    ours, ours_logits, context = dtgpt_loss(labels), logits, contextlib.nullcontext
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.tensor.parallel import loss_parallel

        ours_logits = distribute_tensor(logits, mesh, [Shard(-1)])
        if torch_loss_parallel:
            context = loss_parallel
        else:
            ours = dtgpt_loss(labels, vocab_parallel_cross_entropy_sum)
    for _ in range(2):  # warm-up: first calls dispatch extra ops
        count(plain_loss, logits, labels), count(ours, ours_logits, labels, context)
    (plain_ops, _, plain_value), (ours_ops, syncs, ours_value) = count(plain_loss, logits, labels), count(ours, ours_logits, labels, context)
    return {"plain": plain_ops, "dtgpt": ours_ops, "ratio": ours_ops / plain_ops, "difference": abs(ours_value - plain_value),
            "host_syncs": syncs}  # fmt: skip


RESULT = "bench_loss_ops result: "


def tp_worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    try:
        r = measure(DTYPES[args.dtype], args.tokens, args.vocab, init_device_mesh("cpu", (args.tp,)), args.torch_loss_parallel)
        if dist.get_rank() == 0:
            print(RESULT + " ".join(f"{k}={v!r}" for k, v in r.items()), flush=True)
    finally:
        dist.destroy_process_group()


def measure_tp(dtype: str, tokens: int, vocab: int, tp: int = 2, timeout: int = 600, torch_loss_parallel: bool = False) -> dict:
    """measure() with loss parallelism, on `tp` gloo ranks launched by torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", __file__,
           "--worker", "--tp", str(tp), "--dtype", dtype, "--tokens", str(tokens), "--vocab", str(vocab)]  # fmt: skip
    cmd += ["--torch-loss-parallel"] if torch_loss_parallel else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return {k: float(v) for k, v in (item.split("=") for item in line[len(RESULT):].split())}
    sys.stderr.write(proc.stdout)
    raise SystemExit(f"error: the {tp}-rank measurement exited with {proc.returncode} and printed no result")


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="the logits' dtype")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--tp", type=int, default=1, help="tp ranks: above 1, dtgpt's loss is the loss-parallel one")
    p.add_argument("--torch-loss-parallel", action="store_true", help="with --tp: count torch's loss_parallel() as dtgpt's side")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("tokens", "vocab"):  # 0 tokens gave a NaN difference, negative ones a traceback
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be 1 or more")
    if args.tp < 1 or args.vocab % args.tp:
        p.error(f"--tp={args.tp} must be 1 or more and divide --vocab={args.vocab}")
    if args.worker:
        tp_worker(args)
        return 0
    if args.tp == 1:
        r = measure(DTYPES[args.dtype], args.tokens, args.vocab)
    else:
        r = measure_tp(args.dtype, args.tokens, args.vocab, args.tp, torch_loss_parallel=args.torch_loss_parallel)
    parallel = f", loss parallel over {args.tp} ranks" if args.tp > 1 else ""
    parallel += " (torch's loss_parallel)" if args.torch_loss_parallel else ""
    print(f"loss over {args.tokens} tokens x {args.vocab} vocabulary, {args.dtype} logits{parallel}, forward + backward")
    print(f"aten ops: dtgpt {r['dtgpt']:.0f} (host syncs {r['host_syncs']:.0f}), plain {r['plain']:.0f}, ratio {r['ratio']:.2f}; "
          f"|loss difference| {r['difference']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
