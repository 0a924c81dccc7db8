"""dtgpt's MoE router and layer against megatron-core 0.16.1's (tests/megatron_moe.py) on CPU:
for the same weights and tokens, the same router probabilities, routing, layer output, gradients
and auxiliary losses, option by option."""

import pytest
import torch

from dtgpt.config import ModelConfig
from dtgpt.moe.router import Router, capacity, switch_loss
from tests.megatron_moe import BATCH, FFN, HIDDEN, SEQ, build_layer, megatron_session, run_megatron

AUX = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
CASES = {
    # name: megatron-core TransformerConfig MoE fields (num_moe_experts is dtgpt's num_experts)
    "softmax": dict(**AUX, moe_z_loss_coeff=1e-3),
    "pre_softmax": dict(**AUX, moe_router_pre_softmax=True),
    "top1": dict(**AUX, moe_router_topk=1, moe_router_pre_softmax=True),
    "sigmoid": dict(**AUX, moe_router_score_function="sigmoid", moe_z_loss_coeff=1e-3),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2),
    "expert_bias": dict(moe_router_load_balancing_type="none", moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True),
    "capacity_probs": dict(**AUX, moe_expert_capacity_factor=1.0),
    "capacity_position": dict(**AUX, moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"),
    "capacity_padded": dict(**AUX, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
}  # fmt: skip


@pytest.fixture
def megatron(monkeypatch):
    yield from megatron_session(monkeypatch)


def dtgpt_config(moe: dict) -> ModelConfig:
    return ModelConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, add_bias_linear=False,
        num_experts=4, **{"moe_router_topk": 2, **moe},
    )  # fmt: skip


def inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)


def _same(ours, theirs, what):
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_router_matches_megatron(megatron, case):
    moe = CASES[case]
    layer = build_layer(num_moe_experts=4, **{"moe_router_topk": 2, **moe})
    router = Router(dtgpt_config(moe))
    with torch.no_grad():
        router.weight.copy_(layer.router.weight)
        if router.expert_bias is not None:  # a bias large enough to change some choices
            bias = torch.tensor([0.3, -0.2, 0.0, 0.1])
            router.expert_bias.copy_(bias)
            layer.router.expert_bias.copy_(bias)
    x, upstream = inputs()
    theirs = run_megatron(layer, x, upstream)
    tokens = x.transpose(0, 1).reshape(-1, HIDDEN)
    ours = router(tokens, BATCH, weighted=True)
    assert torch.equal(ours.routing_map, theirs.routing_map), case
    _same(ours.probs, theirs.probs, "probs")
    assert {k: float(v) for k, v in ours.logged.items()} == pytest.approx(theirs.losses, rel=1e-5), case
    if "capacity" in case:  # the case drops something (or pads), and keeps each expert within capacity
        cap = capacity(SEQ * BATCH, 4, moe.get("moe_router_topk", 2), moe["moe_expert_capacity_factor"])
        per_expert = ours.routing_map.sum(0)
        assert (per_expert == cap).all() if moe.get("moe_pad_expert_input_to_capacity") else (per_expert <= cap).all()
        assert int(ours.dropped) > 0


def test_switch_loss_is_balanced_at_its_minimum():
    """E * sum f_e P_e: uniform loads and scores give exactly 1 (the coefficient's unit)."""
    tokens, experts, k = 8, 4, 2
    uniform = switch_loss(torch.full((experts,), tokens / experts), torch.full((experts,), tokens * k / experts), tokens, k)
    assert float(uniform) == pytest.approx(1.0)
    skewed = switch_loss(torch.tensor([8.0, 0, 0, 0]), torch.tensor([8.0, 8, 0, 0]), tokens, k)
    assert float(skewed) > 1.0


def test_expert_bias_moves_towards_the_mean_load():
    router = Router(dtgpt_config(dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                      moe_router_bias_update_rate=0.01)))  # fmt: skip
    router.init_buffers()
    router.update_expert_bias(torch.tensor([8.0, 2.0, 5.0, 5.0]))  # mean 5
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
