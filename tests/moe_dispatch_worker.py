"""AllToAllDispatcher against LocalDispatcher, for tests/test_moe_dispatch.py: torchrun, gloo, 2 or 4 ranks.

Every rank builds every rank's tokens (a different count per rank, top-2 routing, one expert that
rank 0 never picks) and the full experts. The reference runs them all through LocalDispatcher and
the full experts in this one process; the expert-parallel run gives each rank its own tokens and
its own slice of the experts. Each rank checks its outputs and the gradients of its tokens, of
their probabilities and of its experts' weights against the reference's.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from dtgpt.moe.dispatch import AllToAllDispatcher, LocalDispatcher
from dtgpt.moe.experts import GroupedExperts

CASES = [  # (experts, grouped_gemm, swiglu, bias, capacity)
    (4, True, True, False, None),
    (8, False, False, True, None),
    (8, True, True, True, 16),
    (8, False, False, True, 16),
]


def rank_data(rank: int, experts: int, hidden: int):
    """Rank `rank`'s tokens, probs, routing map and the gradient its loss sends back."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 6 + 3 * rank
    x = torch.randn(n, hidden, generator=g)
    logits = torch.randn(n, experts, generator=g)
    if rank == 0:
        logits[:, 1] = -torch.inf  # expert 1 receives nothing from rank 0
    top, idx = logits.topk(2, dim=-1)
    routing_map = torch.zeros(n, experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(n, experts).scatter(1, idx, top.softmax(-1))
    return x, probs, routing_map, torch.randn(n, hidden, generator=g)


def forward_backward(dispatcher, experts, x, probs, routing_map, grad, capacity=None):
    x, probs = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    x_sorted, counts = dispatcher.dispatch(x, probs, routing_map, capacity=capacity, topk=None if capacity else 2)
    out = dispatcher.combine(experts(x_sorted, counts, dispatcher.counts_on_host))
    (out * grad).sum().backward()
    return out.detach(), x.grad, probs.grad


def check(case, rank: int, world: int, group) -> None:
    experts, grouped, swiglu, bias, capacity = case
    hidden = 16
    full = GroupedExperts(experts, hidden, 24, swiglu, bias, grouped, init_std=0.3, output_init_std=0.2)
    full.init_weights(7)
    if bias:
        with torch.no_grad():
            full.fc1_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(8))
            full.fc2_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(9))
    data = [rank_data(r, experts, hidden) for r in range(world)]
    everything = [torch.cat(parts) for parts in zip(*data)]
    ref_out, ref_gx, ref_gp = forward_backward(LocalDispatcher(experts), full, *everything)
    first = sum(d[0].shape[0] for d in data[:rank])
    mine = slice(first, first + data[rank][0].shape[0])

    per_rank = experts // world
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    sharded = GroupedExperts(experts, hidden, 24, swiglu, bias, grouped, init_std=0.3, output_init_std=0.2)
    for name, param in full.named_parameters():
        setattr(sharded, name, nn.Parameter(param.detach()[local].clone()))
    out, gx, gp = forward_backward(AllToAllDispatcher(experts, group), sharded, *data[rank], capacity=capacity)

    def close(actual, expected, what):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} rank {rank} {what}: {m}")

    close(out, ref_out[mine], "output")
    close(gx, ref_gx[mine], "grad x")
    close(gp, ref_gp[mine], "grad probs")
    for name, param in sharded.named_parameters():
        close(param.grad, getattr(full, name).grad[local], f"grad {name}")
        if rank == 0 and name == "fc1_weight":
            assert param.grad.abs().sum() > 0, "the gradient check has teeth"


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for case in CASES:
            check(case, rank, world, dist.group.WORLD)
        print(f"checked rank {rank}: {len(CASES)} cases", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
