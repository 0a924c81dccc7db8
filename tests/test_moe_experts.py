"""dtgpt.moe.experts: the grouped-GEMM experts against their for-loop oracle and a plain MLP.

fp32: grouped equals the loop exactly (forward and every gradient); bf16: close. Experts with no
tokens, sizes grouped_mm cannot take as they are (padded), the zero-stride gradient of `.sum()`,
padded rows and the initialisation are each checked on their own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtgpt.moe.experts import GroupedExperts, grouped_linear, looped_linear


def make_experts(grouped: bool, *, experts=4, hidden=16, ffn=24, swiglu=True, bias=True, seed=0) -> GroupedExperts:
    module = GroupedExperts(experts, hidden, ffn, swiglu, bias, grouped, init_std=0.2, output_init_std=0.1)
    module.init_weights(seed)
    if bias:  # zero at init: give them values so that their handling is tested
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed + 1)
            module.fc1_bias.normal_(0, 0.1, generator=g)
            module.fc2_bias.normal_(0, 0.1, generator=g)
    return module


def run(module: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor | None = None):
    """(output, grad of x, {param: grad}) of one forward-backward against `grad` (default: .sum())."""
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x, counts)
    (y.sum() if grad is None else (y * grad).sum()).backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def reference(module: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert as a plain MLP written out from Megatron's per-expert shapes."""
    outs = []
    for e, rows in enumerate(x.split(counts)):
        h = F.linear(rows, module.fc1_weight[e], module.fc1_bias[e] if module.fc1_bias is not None else None)
        if module.swiglu:
            gate, up = h.chunk(2, dim=-1)  # [gate; fc1]
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        outs.append(F.linear(h, module.fc2_weight[e], module.fc2_bias[e] if module.fc2_bias is not None else None))
    return torch.cat(outs)


COUNTS = [5, 0, 7, 3]  # an expert with no tokens, between others


@pytest.mark.parametrize("swiglu,bias", [(True, False), (False, True), (True, True)])
def test_grouped_equals_loop_exactly_in_fp32(swiglu, bias):
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), 16, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(sum(COUNTS), 16, generator=torch.Generator().manual_seed(4))
    grouped = run(make_experts(True, swiglu=swiglu, bias=bias), x, counts, grad)
    looped = run(make_experts(False, swiglu=swiglu, bias=bias), x, counts, grad)
    assert torch.equal(grouped[0], looped[0]) and torch.equal(grouped[1], looped[1])
    assert grouped[2].keys() == looped[2].keys()
    for name in grouped[2]:
        assert torch.equal(grouped[2][name], looped[2][name]), name
    # ... and both compute the plain per-expert MLP.
    torch.testing.assert_close(grouped[0], reference(make_experts(True, swiglu=swiglu, bias=bias), x, COUNTS))


def test_experts_without_tokens_get_zero_gradients_not_none():
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), 16)
    for grouped in (True, False):
        _, _, grads = run(make_experts(grouped), x, counts)
        for name, g in grads.items():
            assert torch.count_nonzero(g[1]) == 0, (grouped, name)
            assert torch.count_nonzero(g[0]) > 0, (grouped, name)  # the check can fail
    # No token at all: every gradient is zero, and still there.
    for grouped in (True, False):
        y, gx, grads = run(make_experts(grouped), torch.zeros(0, 16), torch.zeros(4, dtype=torch.long))
        assert y.shape == (0, 16) and gx.shape == (0, 16)
        assert all(torch.count_nonzero(g) == 0 for g in grads.values()) and len(grads) == 4


def test_a_sum_gradient_with_zero_strides_runs_backward():
    """`.sum()` hands back an expanded (zero-stride) gradient, which grouped_mm rejects as it comes."""
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="strides"):
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets).sum().backward()
    grouped_linear(x, w, offsets).sum().backward()
    expected = looped_linear(x.detach(), w.detach(), [2, 0, 4])
    torch.testing.assert_close(grouped_linear(x, w, offsets), expected, rtol=0, atol=0)


@pytest.mark.parametrize("hidden,ffn", [(6, 10), (8, 5)])
def test_sizes_grouped_mm_cannot_take_are_padded(hidden, ffn):
    """Strides must be multiples of 16 bytes; these sizes are not (fp32), and still compute."""
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(9, hidden)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(x, torch.randn(4, hidden, ffn), offs=counts.cumsum(0).to(torch.int32))
    grouped = run(make_experts(True, hidden=hidden, ffn=ffn), x, counts)
    looped = run(make_experts(False, hidden=hidden, ffn=ffn), x, counts)
    torch.testing.assert_close(grouped[0], looped[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped[1], looped[1], rtol=1e-6, atol=1e-6)
    for name in grouped[2]:
        torch.testing.assert_close(grouped[2][name], looped[2][name], rtol=1e-6, atol=1e-6)
        assert grouped[2][name].shape == getattr(make_experts(True, hidden=hidden, ffn=ffn), name).shape


def test_bf16_grouped_is_close_to_loop():
    counts = torch.tensor([40, 0, 56, 32])
    x = torch.randn(128, 32).bfloat16()
    grouped, looped = make_experts(True, hidden=32, ffn=64).bfloat16(), make_experts(False, hidden=32, ffn=64).bfloat16()
    g, l = run(grouped, x, counts), run(looped, x, counts)
    assert g[0].dtype == torch.bfloat16
    torch.testing.assert_close(g[0], l[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g[1], l[1], rtol=2e-2, atol=2e-2)
    for name in g[2]:
        torch.testing.assert_close(g[2][name].float(), l[2][name].float(), rtol=3e-2, atol=3e-2)


def test_zero_padded_rows_give_finite_outputs_and_no_gradient():
    """Capacity padding: zero rows inside an expert's block; a zero incoming gradient there."""
    counts = torch.tensor([4, 4, 4, 4])
    x = torch.randn(16, 16)
    real = torch.tensor([1, 1, 0, 0] * 4, dtype=torch.bool)  # two real rows per expert
    x[~real] = 0
    grad = torch.randn(16, 16) * real[:, None]
    for grouped in (True, False):
        module = make_experts(grouped)
        y, gx, grads = run(module, x, counts, grad)
        assert torch.isfinite(y).all() and torch.count_nonzero(gx[~real]) == 0
        # The same gradients as the real rows alone.
        _, _, alone = run(module, x[real], torch.full((4,), 2), grad[real])
        for name in grads:
            torch.testing.assert_close(grads[name], alone[name], rtol=1e-5, atol=1e-6)


def test_init_draws_the_full_experts_and_is_reproducible():
    a, b = make_experts(True, bias=False), make_experts(False, bias=False)
    assert torch.equal(a.fc1_weight, b.fc1_weight) and torch.equal(a.fc2_weight, b.fc2_weight)
    assert a.fc1_weight.std().item() == pytest.approx(0.2, rel=0.1)
    assert a.fc2_weight.std().item() == pytest.approx(0.1, rel=0.1)
    assert not torch.equal(a.fc1_weight[0], a.fc1_weight[1])  # experts differ from each other
    module = GroupedExperts(4, 16, 24, True, True, True, init_std=0.2, output_init_std=0.1)
    module.init_weights(0)
    assert torch.count_nonzero(module.fc1_bias) == 0 and torch.count_nonzero(module.fc2_bias) == 0
    assert module.fc1_weight.shape == (4, 48, 16) and module.fc2_weight.shape == (4, 16, 24)
    # A module holding two of the four experts gets the full tensor's rows through `assign`.
    half = GroupedExperts(4, 16, 24, True, False, True, init_std=0.2, output_init_std=0.1)
    half.fc1_weight = torch.nn.Parameter(torch.empty(2, 48, 16))
    half.fc2_weight = torch.nn.Parameter(torch.empty(2, 16, 24))
    with pytest.raises(ValueError, match="holds 2 of 4 experts"):
        half.init_weights(0)
    half.init_weights(0, assign=lambda p, full: p.data.copy_(full[2:]))
    assert torch.equal(half.fc1_weight, a.fc1_weight[2:]) and torch.equal(half.fc2_weight, a.fc2_weight[2:])
    # The seed and the name decide the values.
    other = GroupedExperts(4, 16, 24, True, False, True, init_std=0.2, output_init_std=0.1)
    other.init_weights(0, prefix="layers.1.mlp.experts.")
    assert not torch.equal(other.fc1_weight, a.fc1_weight)


def test_standalone_init_draws_what_the_model_draws():
    """GroupedExperts.init_weights (with its name in the model) gives the values GPT.init_weights
    gives the same parameters through the layer's declared inits: one initialisation, two callers."""
    from dtgpt.config import ModelConfig
    from dtgpt.model import GPT

    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_experts=4, add_bias_linear=True)
    gpt = GPT(cfg, vocab_size=64)
    gpt.init_weights(seed=3)
    experts = gpt.layers["1"].mlp.experts
    alone = GroupedExperts(4, 16, cfg.expert_ffn_size, cfg.swiglu, True, True, experts.init_std, experts.output_init_std)
    alone.init_weights(3, prefix="layers.1.mlp.experts.")
    for name, param in alone.named_parameters():
        assert torch.equal(param, getattr(experts, name)), name
    assert not torch.equal(alone.fc1_weight, gpt.layers["0"].mlp.experts.fc1_weight)
