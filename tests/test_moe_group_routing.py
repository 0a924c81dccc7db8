"""Group-limited routing and the routed weights' scaling (dtgpt/moe/group_routing.py) against
megatron-core's TopKRouter (tests/megatron_moe.py) on CPU, and Megatron's per-block
moe_layer_freq pattern (dtgpt/config/layer_freq.py), which is read without running any code."""

import pytest
import torch

from dtgpt.config import Config, ConfigError, ModelConfig, validate
from dtgpt.config.layer_freq import moe_layer_pattern
from dtgpt.model import GPT
from dtgpt.moe.group_routing import group_limited_topk
from dtgpt.moe.layer import MoELayer
from dtgpt.moe.router import Router
from tests.megatron_moe import BATCH, FFN, HIDDEN, SEQ, build_layer, megatron_session, run_megatron

EXPERTS, GROUPS = 8, 4
GROUPED = dict(moe_router_topk=4, moe_router_num_groups=GROUPS, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)
CASES = {
    # DeepSeek-V3's router: sigmoid scores, the expert bias moving the choice, groups, scaled weights
    "sigmoid_bias": dict(**GROUPED, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2),
    "softmax": dict(**GROUPED, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
    "pre_softmax": dict(**GROUPED, moe_router_pre_softmax=True, moe_router_load_balancing_type="none"),
}  # fmt: skip


@pytest.fixture
def megatron(monkeypatch):
    yield from megatron_session(monkeypatch)


def dtgpt_config(moe: dict) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                       add_bias_linear=False, num_experts=EXPERTS, **moe)  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_group_limited_router_matches_megatron(megatron, case):
    moe = CASES[case]
    layer = build_layer(num_moe_experts=EXPERTS, **moe)
    router = Router(dtgpt_config(moe))
    with torch.no_grad():
        router.weight.copy_(layer.router.weight)
        if router.expert_bias is not None:
            bias = torch.linspace(-0.3, 0.3, EXPERTS)
            router.expert_bias.copy_(bias)
            layer.router.expert_bias.copy_(bias)
    g = torch.Generator().manual_seed(3)
    x, upstream = torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    theirs = run_megatron(layer, x, upstream)
    ours = router(x.transpose(0, 1).reshape(-1, HIDDEN), BATCH, weighted=True)
    assert torch.equal(ours.routing_map, theirs.routing_map), case
    torch.testing.assert_close(ours.probs, theirs.probs, rtol=1e-5, atol=1e-6)
    assert {k: float(v) for k, v in ours.logged.items()} == pytest.approx(theirs.losses, rel=1e-5), case
    # the groups limit the choice: every token's experts lie in at most moe_router_group_topk groups
    groups_used = ours.routing_map.view(-1, GROUPS, EXPERTS // GROUPS).any(-1).sum(-1)
    assert int(groups_used.max()) <= moe["moe_router_group_topk"]
    # the weights are scaled: each token's weights sum to the factor (sigmoid: normalised first)
    if case == "sigmoid_bias":
        torch.testing.assert_close(ours.probs.sum(-1), torch.full((BATCH * SEQ,), 2.5))


def test_group_limit_changes_the_choice():
    """Groups of 2 scored by their top 2 (k / group_topk): group 2 (0.8 + 0.7) beats group 0 (0.9 + 0.1)."""
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.8, 0.7, 0.0, 0.0]])
    assert sorted(torch.topk(scores, 2).indices[0].tolist()) == [0, 4]
    assert sorted(group_limited_topk(scores, 2, num_groups=4, group_topk=1)[1][0].tolist()) == [4, 5]


PATTERNS = ["([0]*3+[1]*5)", "[0,1,1,1]*2", "[1]+[0]*7", "2", 1]


@pytest.mark.parametrize("freq", PATTERNS)
def test_layer_freq_reads_megatron_patterns(freq):
    expected = [i % int(freq) == 0 for i in range(8)] if str(freq).isdigit() else [bool(v) for v in eval(freq)]  # our constants
    assert list(moe_layer_pattern(freq, 8)) == expected
    model = GPT(ModelConfig(num_layers=8, hidden_size=16, num_attention_heads=2, num_experts=4, moe_layer_freq=freq), 32)
    assert [isinstance(block.mlp, MoELayer) for block in model.layers.values()] == expected


BAD_FREQ = {
    "__import__('os').system('true')": "is neither an int nor a list expression",
    "[2]*8": "not 0 or 1",
    "[1]*(10**9)": "multiplies a list by something other than a count",
    "[1]*7": "lists 7 blocks, but model.num_layers=8",
    "[0]*4+": "is not an int or a list expression",
}


@pytest.mark.parametrize("freq", sorted(BAD_FREQ))
def test_bad_layer_freq_is_one_line(freq):
    cfg = Config()
    cfg.model.num_layers, cfg.model.num_experts, cfg.model.moe_layer_freq = 8, 4, freq
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert BAD_FREQ[freq] in str(err.value) and "\n" not in str(err.value)


BAD_GROUPS = {
    "needs model.moe_router_num_groups": dict(moe_router_group_topk=2),
    "must divide model.num_experts=8": dict(moe_router_group_topk=1, moe_router_num_groups=3),
    "must be in [1, model.moe_router_num_groups=2]": dict(moe_router_group_topk=3, moe_router_num_groups=2),
    "model.moe_router_topk=2 must be in [moe_router_group_topk=4": dict(moe_router_group_topk=4, moe_router_num_groups=4),
    "model.moe_router_topk_scaling_factor=0.0 must be > 0": dict(moe_router_topk_scaling_factor=0.0),
}


@pytest.mark.parametrize("expected", sorted(BAD_GROUPS))
def test_bad_group_routing_is_one_line(expected):
    cfg = Config()
    cfg.model.num_experts = 8
    for key, value in BAD_GROUPS[expected].items():
        setattr(cfg.model, key, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expected in str(err.value) and "\n" not in str(err.value)
