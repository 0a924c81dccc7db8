"""A minimal reproduction: the AOTAutograd cache hands a compiled DTensor graph to another group.

    TORCHINDUCTOR_CACHE_DIR=EMPTY_DIR torchrun --nproc-per-node 2 tests/compile_cache_worker.py

Compile one function of a sharded DTensor (an all-gather) on a group A, then the same function on
a group B of the same ranks after resetting dynamo (as a new process would start), with A gone.
Torch 2.13 takes B's graph from its AOTAutograd cache, filled for A and keeping A's group name:
the call fails with "Could not resolve the process group registered under the name ...". (With
TORCHINDUCTOR_AUTOGRAD_CACHE=0 it passes, the FX graph cache on.) Exit status 0 means the graph
ran on B and gathered the right values: torch then keys the cache by the group, and
dtgpt.parallel.compile may leave it on under tp.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def gather_doubled(x: DTensor) -> torch.Tensor:
    return x.redistribute(placements=[Replicate()]).to_local() * 2


def gather_on(group: dist.ProcessGroup) -> torch.Tensor:
    mesh = DeviceMesh.from_group(group, "cpu")
    local = torch.full((2, 3), float(dist.get_rank() + 1))
    return torch.compile(gather_doubled)(DTensor.from_local(local, mesh, [Shard(0)]))


def main() -> None:
    dist.init_process_group("gloo")
    group_a = dist.new_group([0, 1])
    first = gather_on(group_a)
    dist.destroy_process_group(group_a)
    torch._dynamo.reset()  # forget compiled frames, as a new process would; the caches stay
    second = gather_on(dist.new_group([0, 1]))
    expected = torch.tensor([2.0, 2.0, 4.0, 4.0])
    assert torch.equal(first[:, 0], expected) and torch.equal(second[:, 0], expected), (first, second)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
