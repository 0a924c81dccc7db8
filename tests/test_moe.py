"""dtgpt's MoE router and layer against megatron-core's (tests/megatron_moe.py) on CPU:
for the same weights and tokens, the same router probabilities, routing, layer output, gradients
and auxiliary losses, option by option."""

import dataclasses

import pytest
import torch

from dtgpt.config import ModelConfig
from dtgpt.mlp import MLP
from dtgpt.moe.layer import MoELayer
from dtgpt.moe.router import Router, capacity, switch_loss
from tests.megatron_moe import BATCH, FFN, HIDDEN, SEQ, build_layer, expert_weights, megatron_session, run_megatron

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
    "router_fp64": dict(**AUX, moe_router_dtype="fp64", moe_z_loss_coeff=1e-3),
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
    assert ours.probs.dtype == theirs.probs.dtype == (torch.float64 if "fp64" in case else torch.float32)
    _same(ours.probs, theirs.probs, "probs")
    assert {k: float(v) for k, v in ours.logged.items()} == pytest.approx(theirs.losses, rel=1e-5), case
    if "capacity" in case:  # the case drops something (or pads), and keeps each expert within capacity
        cap = capacity(SEQ * BATCH, 4, moe.get("moe_router_topk", 2), moe["moe_expert_capacity_factor"])
        per_expert = ours.routing_map.sum(0)
        assert (per_expert == cap).all() if moe.get("moe_pad_expert_input_to_capacity") else (per_expert <= cap).all()
        assert int(ours.dropped) > 0


@pytest.mark.parametrize("router_dtype", [None, "fp32", "fp64"])
def test_router_dtype_sets_the_logits_dtype_and_gradients_keep_theirs(router_dtype):
    """Under bf16 the router computes in moe_router_dtype (unset: bf16), its weight's and input's
    gradients coming back in their own dtypes (Megatron's gating linear)."""
    router = Router(dtgpt_config(dict(AUX, moe_router_dtype=router_dtype))).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    x = torch.randn(8, HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    routing = router(x, 2, weighted=True)
    want = {None: torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[router_dtype]
    assert routing.probs.dtype == want and router.gating(x).dtype == want
    (routing.probs.sum() + routing.loss).backward()
    assert x.grad.dtype == router.weight.grad.dtype == torch.bfloat16


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


def same_layer_as_megatron(theirs_layer, moe: dict, prepare=lambda layer: None):
    """dtgpt's MoELayer with megatron-core's `theirs_layer`'s weights (then given to `prepare`),
    both run on the same tokens: asserts the same output and router, input and expert gradients;
    returns (ours, their run)."""
    cfg = dtgpt_config(moe)
    shared = cfg.moe_shared_expert_intermediate_size
    ours_layer = MoELayer(cfg, MLP(dataclasses.replace(cfg, ffn_hidden_size=shared)) if shared else None)  # as dtgpt.model's Block
    prepare(ours_layer)
    fc1, fc2 = expert_weights(theirs_layer)
    with torch.no_grad():
        ours_layer.router.weight.copy_(theirs_layer.router.weight)
        ours_layer.experts.fc1_weight.copy_(fc1)
        ours_layer.experts.fc2_weight.copy_(fc2)
    x, upstream = inputs()
    theirs = run_megatron(theirs_layer, x, upstream)
    x = x.clone().requires_grad_(True)
    out = ours_layer(x)
    (out * upstream).sum().backward()
    _same(out.detach(), theirs.output, "output")
    _same(ours_layer.router.weight.grad, theirs.router_grad, "router gradient")
    _same(x.grad, theirs.input_grad, "input gradient")
    for name in ("fc1", "fc2"):
        their_grad = torch.stack([getattr(e, f"linear_{name}").weight.grad for e in theirs_layer.experts.local_experts])
        _same(getattr(ours_layer.experts, f"{name}_weight").grad, their_grad, f"expert {name} gradient")
    return ours_layer, theirs


LAYER_CASES = ("softmax", "sigmoid", "seq_aux_loss", "capacity_probs", "capacity_padded", "router_fp64")


@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_matches_megatron(megatron, case):
    """Output, and the gradients of the router (LM and aux/z losses together), the input and the
    experts, for (output * upstream).sum() with the aux gradient at scale 1, as Megatron's
    MoEAuxLossAutoScaler at loss scale 1."""
    moe = CASES[case]
    ours_layer, theirs = same_layer_as_megatron(build_layer(num_moe_experts=4, **{"moe_router_topk": 2, **moe}), moe)
    totals = ours_layer.take_totals()
    assert {k: float(totals[k]) for k in theirs.losses} == pytest.approx(theirs.losses, rel=1e-5)
    assert int(totals["tokens_per_expert"].sum()) + int(totals["dropped_tokens"]) >= SEQ * BATCH * 2 or "padded" in case


def test_shared_expert_gate_matches_megatron(megatron):
    """Megatron's shared expert with its gate (sigmoid(x . w) scales its output): the same output
    and gradients of the gate, the shared expert's weights and the input."""
    moe = dict(**AUX, moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
    theirs_layer = build_layer(num_moe_experts=4, moe_router_topk=2, **moe)
    shared = theirs_layer.shared_experts
    with torch.no_grad():  # a gate far from 1/2, so that a missing or misplaced one shows
        shared.gate_weight.normal_(0.0, 0.5)

    def prepare(ours):
        with torch.no_grad():
            ours.shared_expert_gate.weight.copy_(shared.gate_weight)
            ours.shared_expert.fc1.weight.copy_(shared.linear_fc1.weight)
            ours.shared_expert.fc2.weight.copy_(shared.linear_fc2.weight)

    ours, _ = same_layer_as_megatron(theirs_layer, moe, prepare)
    _same(ours.shared_expert_gate.weight.grad, shared.gate_weight.grad, "gate gradient")
    _same(ours.shared_expert.fc1.weight.grad, shared.linear_fc1.weight.grad, "shared fc1 gradient")
    _same(ours.shared_expert.fc2.weight.grad, shared.linear_fc2.weight.grad, "shared fc2 gradient")


def test_aux_gradient_reaches_the_router_only_and_scales():
    """The aux loss adds d(coeff * loss)/d(router) * aux_loss_scale to the router's gradient and
    nothing to the experts'."""
    torch.manual_seed(0)
    layer = MoELayer(dtgpt_config(dict(AUX, moe_aux_loss_coeff=5.0)))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, _ = inputs()

    def grads(scale: float, train: bool = True):
        layer.zero_grad(set_to_none=True)
        layer.aux_loss_scale = scale
        layer.train(train)
        layer(x).sum().backward()
        layer.take_totals()
        return layer.router.weight.grad.clone(), layer.experts.fc1_weight.grad.clone()

    plain_router, plain_experts = grads(0.0)
    router1, experts1 = grads(1.0)
    router3, experts3 = grads(3.0)
    torch.testing.assert_close(experts1, plain_experts)
    torch.testing.assert_close(experts3, plain_experts)
    aux = router1 - plain_router
    assert aux.norm() > 1e-2 * plain_router.norm()
    torch.testing.assert_close(router3 - plain_router, 3 * aux, rtol=1e-3, atol=1e-4 * float(aux.abs().max()))
    eval_router, _ = grads(1.0, train=False)  # no aux loss outside training, as Megatron
    torch.testing.assert_close(eval_router, plain_router)


def test_gpt_places_moe_layers_by_frequency_and_inits_them_on_full_shapes():
    from dtgpt.mlp import MLP
    from dtgpt.model import GPT

    cfg = dtgpt_config(dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                            moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True, moe_layer_freq=2))  # fmt: skip
    cfg.num_layers, cfg.untie_embeddings_and_output_weights = 3, True
    with torch.device("meta"):
        model = GPT(cfg, vocab_size=64)
    assert [type(b.mlp) for b in model.layers.values()] == [MoELayer, MLP, MoELayer]
    assert model.layers["0"].mlp.shared_expert.fc1.out_features == 8
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    params = dict(model.named_parameters())
    assert params["layers.2.mlp.experts.fc1_weight"].shape == (4, FFN, HIDDEN)
    assert float(params["layers.2.mlp.experts.fc1_weight"].detach().std()) == pytest.approx(cfg.init_method_std, rel=0.2)
    assert torch.equal(model.layers["0"].mlp.router.expert_bias, torch.zeros(4))  # a buffer, set by init too
    assert params["layers.0.mlp.shared_expert_gate.weight"].shape == (1, HIDDEN)  # drawn by init, as Megatron's
    assert params["layers.0.mlp.shared_expert_gate.weight"].abs().min() > 0
    again = GPT(cfg, vocab_size=64)
    again.init_weights(seed=5)
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in params.items())
    logits = model(torch.randint(0, 64, (2, 8)))
    logits.sum().backward()
    assert params["layers.0.mlp.router.weight"].grad is not None


def test_a_recomputed_forward_is_not_counted_twice():
    """Under non-reentrant checkpointing backward reruns the layer; its routing is counted once
    (early stop off: the rerun then reaches the counting, as it may for any layer)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    layer = MoELayer(dtgpt_config(AUX))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, _ = inputs()
    with set_checkpoint_early_stop(False):
        checkpoint(layer, x.requires_grad_(True), use_reentrant=False).sum().backward()
    assert int(layer.take_totals()["tokens_per_expert"].sum()) == BATCH * SEQ * 2


def test_closed_form_size_counts_the_experts():
    from dtgpt.model import GPT
    from dtgpt.model_size import flops_per_token, num_parameters

    moe = dtgpt_config(dict(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True, moe_layer_freq=2, moe_ffn_hidden_size=12))
    moe.num_layers, moe.add_bias_linear = 3, True
    model = GPT(moe, vocab_size=64)
    assert num_parameters(moe, 64) == sum(p.numel() for p in model.parameters())
    dense = dtgpt_config({})
    dense.num_experts, dense.num_layers, dense.add_bias_linear = None, 3, True
    # two MoE blocks run 2 experts of 12 plus a shared 8 (32) where the dense MLP runs 24
    extra = 2 * 12 * HIDDEN * HIDDEN * (32 - FFN) / HIDDEN
    assert flops_per_token(moe, 64) == pytest.approx(flops_per_token(dense, 64) + extra)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_sequence_parallel_shares_sum_to_the_whole_loss(kind):
    """Two ranks holding half the positions each (what tp ranks hold under sequence parallelism,
    contiguous rows in position-major order), with counts summed between them: their losses add
    up to the one-rank loss, load-balancing and z loss alike."""
    router = Router(dtgpt_config(dict(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)))
    torch.nn.init.normal_(router.weight, std=0.5)
    x, _ = inputs()
    tokens = x.transpose(0, 1).reshape(-1, HIDDEN)
    whole = router(tokens, BATCH, weighted=True)
    halves = tokens.chunk(2)
    counts = []
    router.sum_over_sequence_ranks = lambda c: counts.append(c) or c
    for half in halves:
        router(half, BATCH, weighted=True)
    router.sequence_ranks, router.sum_over_sequence_ranks = 2, lambda c: counts[0] + counts[1]
    shares = [router(half, BATCH, weighted=True) for half in halves]
    torch.testing.assert_close(shares[0].loss + shares[1].loss, whole.loss)
    for name, value in whole.logged.items():
        torch.testing.assert_close(shares[0].logged[name] + shares[1].logged[name], value)
