"""model.moe_router_force_load_balancing (Megatron's --moe-router-force-load-balancing,
dtgpt/moe/forced_balance.py): megatron-core's router on CPU as the oracle for what the draws
replace and what still trains (their draws fed to dtgpt's layer, since the two draw from different
generators), and the draws' own properties: standard normal, balanced loads, a function of the
token and not of who holds it. The layouts: tests/test_parity.py moe_ep2_tp2_sp_cp2_forced_balance."""

import pytest
import torch

import dtgpt.moe.forced_balance as forced_balance
from dtgpt.config import ModelConfig
from dtgpt.model import GPT
from dtgpt.moe.forced_balance import apply_forced_balance, standard_normal
from dtgpt.moe.router import Router
from tests.megatron_moe import BATCH, HIDDEN, SEQ, build_layer, megatron_session
from tests.test_moe import AUX, dtgpt_config, inputs, same_layer_as_megatron

CASES = {
    "softmax": dict(**AUX, moe_z_loss_coeff=1e-3),
    "sigmoid_expert_bias": dict(moe_router_load_balancing_type="none", moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True),
    "group_limited": dict(**AUX, moe_router_num_groups=2, moe_router_group_topk=1),
    "capacity": dict(**AUX, moe_expert_capacity_factor=1.0),
}  # fmt: skip


@pytest.fixture
def megatron(monkeypatch):
    yield from megatron_session(monkeypatch)


@pytest.mark.parametrize("case", sorted(CASES))
def test_forced_balance_trains_as_megatrons(megatron, monkeypatch, case):
    """Megatron's draws (captured from its router) in place of dtgpt's: the same routing, output,
    losses, expert-bias counts and gradients, the router's reaching its weights straight through
    the draws (from the LM loss and from the losses computed on the draws)."""
    from megatron.core.transformer.moe import router as megatron_router

    moe = {**CASES[case], "moe_router_force_load_balancing": True}
    drawn = []
    real = megatron_router.apply_random_logits
    monkeypatch.setattr(megatron_router, "apply_random_logits", lambda logits: drawn.append(real(logits)) or drawn[-1])
    monkeypatch.setattr(forced_balance, "standard_normal", lambda seed, site, token_index, experts: drawn[-1].detach().view(-1, experts))
    theirs_layer = build_layer(num_moe_experts=4, **{"moe_router_topk": 2, **moe})

    def prepare(layer):
        layer.router.forced_balance, layer.router.token_index = (1234, "layers.0.mlp.router"), torch.arange(SEQ * BATCH)

    ours_layer, theirs = same_layer_as_megatron(theirs_layer, moe, prepare)
    assert len(drawn) == 1
    unforced = Router(dtgpt_config(CASES[case]))  # the draws, not the weights, chose the experts
    unforced.load_state_dict(ours_layer.router.state_dict())
    x, _ = inputs()
    assert not torch.equal(unforced(x.transpose(0, 1).reshape(-1, HIDDEN), BATCH, weighted=False).routing_map, theirs.routing_map)
    totals = ours_layer.take_totals()
    assert torch.equal(totals["tokens_per_expert"].long(), theirs.routing_map.sum(0))
    assert {k: float(totals[k]) for k in theirs.losses} == pytest.approx(theirs.losses, rel=1e-5)
    if "expert_bias" in case:
        assert torch.equal(theirs_layer.router.local_tokens_per_expert.long(), theirs.routing_map.sum(0))


def test_draws_are_standard_normal_and_keyed_on_the_token():
    tokens = torch.arange(10_000, 14_096)
    z = standard_normal(1234, "layers.3.mlp.router", tokens, 16)
    assert z.dtype == torch.float32 and z.shape == (4096, 16)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1.0) < 0.01
    assert abs((z.abs() < 1.0).float().mean() - 0.6827) < 0.01  # the normal's mass within one sigma
    # a function of (seed, site, token, expert) alone: any subset of the tokens, in any order, draws the same rows
    picked = tokens[torch.randperm(4096)[:100]]
    assert torch.equal(standard_normal(1234, "layers.3.mlp.router", picked, 16), z[picked - 10_000])
    assert not torch.equal(standard_normal(1234, "layers.2.mlp.router", tokens, 16), z)
    assert not torch.equal(standard_normal(1235, "layers.3.mlp.router", tokens, 16), z)


def test_loads_are_balanced_whatever_the_router_learned():
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_experts=8, moe_router_topk=2,
                      moe_router_force_load_balancing=True, moe_router_dtype="fp32")  # fmt: skip
    router = Router(cfg).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.zero_()
        router.bias.zero_()
        router.weight[0] = 100.0  # every token would pick expert 0, by a logit of 1600
    router.forced_balance, router.token_index = (7, "layers.0.mlp.router"), torch.arange(8192)
    x = torch.ones(8192, 16, dtype=torch.bfloat16)
    routing = router(x, 1, weighted=False)
    expected = torch.softmax(torch.topk(standard_normal(7, "layers.0.mlp.router", router.token_index, 8), 2).values, -1)
    assert torch.equal(torch.topk(routing.probs, 2).values, expected)  # exactly the draws (no rounding at the logits' size)
    loads = routing.routing_map.sum(0).float()
    assert ((loads - 8192 * 2 / 8).abs() / (8192 * 2 / 8) < 0.05).all(), loads
    router.forced_balance = None
    with pytest.raises(ValueError, match="moe_router_force_load_balancing: the router has no token indices"):
        router(x, 1, weighted=False)


def test_each_sequence_parallel_rank_keys_its_own_chunk():
    """Under tp + SP a rank's MoE layer routes its chunk of each sequence, position-major: the
    token indices the hook gives it are that chunk's, so the ranks' draws are the one process's rows."""
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
                      num_experts=4, moe_router_topk=2, moe_router_force_load_balancing=True)  # fmt: skip
    token_index = torch.arange(16).view(2, 8) + 100  # (B, T)
    seen = {}
    for tp_rank in (0, 1):
        model = GPT(cfg, vocab_size=32)
        apply_forced_balance(model, 5, tp_rank=tp_rank, tp=2, sequence_parallel=True)
        block = model.layers["0"]
        block.mlp.forward = lambda x: x  # the hook is what is tested
        block(torch.zeros(2, 4, 16), token_index=token_index)
        seen[tp_rank] = block.mlp.router.token_index
        assert block.mlp.router.forced_balance == (5, "layers.0.mlp.router")
    assert seen[0].tolist() == [100, 108, 101, 109, 102, 110, 103, 111]  # positions 0..3 of both samples, position-major
    assert seen[1].tolist() == [104, 112, 105, 113, 106, 114, 107, 115]
