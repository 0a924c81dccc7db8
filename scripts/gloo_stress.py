"""Async collectives in flight together on one gloo group, round after round: torch's gloo (two
worker threads per group) against dtgpt's (one; dtgpt/parallel/serial_gloo.py).

    torchrun --nproc-per-node 2 scripts/gloo_stress.py --backend gloo --rounds 40000
    torchrun --nproc-per-node 2 scripts/gloo_stress.py --backend serial_gloo --rounds 40000

Each round issues what a training step does on CPU, all on the default group and unwaited until
the end of the round: an all-gather and a reduce-scatter (FSDP's), an all-reduce, and functional
collectives whose results are waited by using them (DTensor's and the loss's token counts). Every
result is checked. A round that makes no progress for --stall-seconds is reported as a hang (gloo's
own timeout does not fire in it); a crash shows as the rank's signal in torchrun's report. The
outcome is one line per rank: `rounds N/M ok`, or `hung in round N`.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

from dtgpt.parallel.collectives import all_gather, all_gather_into, reduce_scatter_into  # noqa: E402
from dtgpt.parallel.serial_gloo import serial_gloo  # noqa: E402


def one_round(i: int, group, world: int) -> None:
    n = 1 + (i * 7919) % 5000  # sizes vary round to round
    shard, gathered, scattered = torch.full((n,), float(dist.get_rank())), torch.empty(world * n), torch.empty(n)
    works = [
        all_gather_into(gathered, shard, group=group, async_op=True),
        reduce_scatter_into(scattered, torch.ones(world * n), group=group, async_op=True),
        dist.all_reduce(summed := torch.ones(n), group=group, async_op=True),
    ]
    rows = all_gather(torch.ones(n // 2 + 1, 3), 0, group=group)
    counts = funcol.all_reduce(torch.tensor([i, 2 * i]), "sum", group=group).clamp(min=1)
    assert counts.tolist() == [max(world * i, 1), max(2 * world * i, 1)], counts
    assert rows.sum().item() == world * (n // 2 + 1) * 3
    for work in reversed(works):
        work.wait()
    assert gathered.view(world, n)[:, 0].tolist() == [float(r) for r in range(world)]
    assert scattered.eq(world).all() and summed.eq(world).all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["gloo", "serial_gloo"], default="serial_gloo")
    parser.add_argument("--rounds", type=int, default=40000)
    parser.add_argument("--stall-seconds", type=float, default=60.0)
    args = parser.parse_args()
    faulthandler.enable(all_threads=True)
    dist.init_process_group(serial_gloo() if args.backend == "serial_gloo" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    done = [0]

    def watch() -> None:
        last, since = -1, time.monotonic()
        while True:
            time.sleep(1.0)
            if done[0] != last:
                last, since = done[0], time.monotonic()
            elif time.monotonic() - since > args.stall_seconds:
                print(f"rank {rank} ({args.backend}): hung in round {last} ({args.stall_seconds:.0f} s without progress)", flush=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
    start = time.monotonic()
    for i in range(args.rounds):
        one_round(i, dist.group.WORLD, world)
        done[0] = i + 1
    print(f"rank {rank} ({args.backend}): rounds {args.rounds}/{args.rounds} ok in {time.monotonic() - start:.0f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
