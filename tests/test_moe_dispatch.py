"""dtgpt.moe.dispatch: the local dispatcher against a plain per-token MoE, padding to capacity, and
the all-to-all dispatcher on 2 and 4 gloo ranks against the local one (tests/moe_dispatch_worker.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from dtgpt.moe.dispatch import LocalDispatcher
from dtgpt.moe.experts import GroupedExperts
from tests.runs import REPO


def routing(tokens: int, experts: int, topk: int, seed: int, unused: tuple[int, ...] = ()):
    """(probs (N, E) softmax over the top-k, routing_map (N, E)), never choosing `unused` experts."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, list(unused)] = -torch.inf
    top, idx = logits.topk(topk, dim=-1)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(tokens, experts).scatter(1, idx, top.softmax(-1))
    return probs, routing_map


def experts_module(grouped: bool, experts: int = 4, hidden: int = 16) -> GroupedExperts:
    module = GroupedExperts(experts, hidden, 32, swiglu=True, bias=False, grouped_gemm=grouped, init_std=0.3, output_init_std=0.2)
    module.init_weights(1)
    return module


def per_token_reference(experts: GroupedExperts, x, probs, routing_map) -> torch.Tensor:
    """For each token on its own: sum over its chosen experts of prob * expert(token)."""
    out = []
    for n in range(x.shape[0]):
        total = torch.zeros(x.shape[1])
        for e in routing_map[n].nonzero().flatten().tolist():
            one = torch.zeros(experts.num_experts, dtype=torch.long)
            one[e] = 1
            total = total + probs[n, e] * experts(x[n : n + 1], one)[0]
        out.append(total)
    return torch.stack(out)


def moe(dispatcher, experts, x, probs, routing_map, **layout):
    x_sorted, counts = dispatcher.dispatch(x, probs, routing_map, **layout)
    return dispatcher.combine(experts(x_sorted, counts, dispatcher.counts_on_host))


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("layout", [{}, {"topk": 2}, {"capacity": 9}, {"capacity": 13}], ids=["counted", "dropless", "capacity", "capacity_over_tokens"])
def test_local_dispatch_and_combine_equal_a_per_token_moe(layout, grouped):
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(0))
    probs, routing_map = routing(12, 4, 2, seed=1, unused=(2,))  # expert 2 gets no token
    experts = experts_module(grouped)
    x1, p1 = leaves(x, probs)
    out = moe(LocalDispatcher(4), experts, x1, p1, routing_map, **layout)
    # Seeded: the probs' gradient is a 16-term dot product whose fp32 rounding differs between the
    # grouped and per-token sums; about 1 random gradient in 80 has a cancellation beyond the
    # tolerance (on torch 2.11 and 2.13 alike), which an unseeded draw made depend on the test order.
    grad = torch.randn(12, 16, generator=torch.Generator().manual_seed(2))
    (out * grad).sum().backward()
    expert_grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    experts.zero_grad(set_to_none=True)
    x2, p2 = leaves(x, probs)
    expected = per_token_reference(experts, x2, p2, routing_map)
    (expected * grad).sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    # probs get a gradient exactly where a token was routed.
    assert torch.equal(p1.grad != 0, routing_map)
    torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-6)
    for name, param in experts.named_parameters():
        torch.testing.assert_close(expert_grads[name], param.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(expert_grads["fc1_weight"][2]) == 0


def test_dispatch_sorts_by_expert_and_pads_to_capacity():
    x = torch.arange(4.0)[:, None].expand(4, 4).clone()  # token n is the row of n's
    routing_map = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)
    probs = routing_map.float() * 0.5
    x_sorted, counts = LocalDispatcher(3).dispatch(x, probs, routing_map)
    assert counts.tolist() == [2, 0, 3] and x_sorted[:, 0].tolist() == [0, 2, 0, 1, 3]
    padded = LocalDispatcher(3)
    x_padded, counts = padded.dispatch(x, probs, routing_map, capacity=3)
    assert counts.tolist() == [3, 3, 3] and padded.counts_on_host == [3, 3, 3] and x_padded.shape == (9, 4)
    assert x_padded[:, 0].tolist() == [0, 2, 0, 0, 0, 0, 0, 1, 3]
    # Padded rows are never read: whatever the experts put there, the result and the gradients are the same.
    y = (x_padded * 2).requires_grad_(True)
    nan = y.detach().clone()
    nan[[2, 3, 4, 5]] = torch.nan
    out = padded.combine(y + (nan - y).detach())
    torch.testing.assert_close(out, 2 * x * probs.sum(1, keepdim=True))
    out.sum().backward()
    assert y.grad[[2, 3, 4, 5]].eq(0).all() and y.grad.isfinite().all()
    # Over capacity (the router never sends it), an expert keeps its first tokens.
    x_sorted, _ = LocalDispatcher(3).dispatch(x, probs, routing_map, capacity=1)
    assert x_sorted[:, 0].tolist() == [0, 0, 0]
    # Dropless: the pairs found without reading the count on the host are the same.
    two = routing(6, 3, 2, seed=3)
    dropless, counted = LocalDispatcher(3), LocalDispatcher(3)
    x6 = torch.randn(6, 4)
    assert torch.equal(dropless.dispatch(x6, *two, topk=2)[0], counted.dispatch(x6, *two)[0])


def test_bad_routing_and_misuse_are_errors():
    x = torch.zeros(4, 4)
    probs, routing_map = routing(4, 3, 2, seed=0)
    with pytest.raises(ValueError, match="must be bool"):
        LocalDispatcher(3).dispatch(x, probs, routing_map.float())
    with pytest.raises(ValueError, match="3 experts"):
        LocalDispatcher(3).dispatch(x, probs[:, :2], routing_map[:, :2])
    with pytest.raises(RuntimeError, match="without a dispatch"):
        LocalDispatcher(3).combine(torch.zeros(8, 4))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_equals_local(world, tmp_path):
    """Outputs and the gradients of x, probs and the experts' weights, each rank against the
    local dispatcher with every expert on one rank and every rank's tokens (see the worker)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(REPO / "tests" / "moe_dispatch_worker.py")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # Ranks print concurrently: their lines may share one line of torchrun's output.
    assert sorted(map(int, re.findall(r"checked rank (\d+)", proc.stdout))) == list(range(world)), proc.stdout
