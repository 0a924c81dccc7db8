"""Megatron's token dispatchers choose how tokens travel, not what is computed: megatron-core's
MoELayer with its alltoall dispatcher (tests/megatron_moe.py; the allgather one is
tests/test_moe.py's oracle) gives dtgpt's layer output and gradients for the same weights,
dropless and with each capacity mode, so dtgpt takes --moe-token-dispatcher-type as a setting
that changes nothing trained (docs/moe.md, "Megatron's token dispatchers")."""

import pytest

from tests.megatron_moe import build_layer, megatron_session
from tests.test_moe import CASES, same_layer_as_megatron


@pytest.fixture
def megatron(monkeypatch):
    yield from megatron_session(monkeypatch)


@pytest.mark.parametrize("case", ["softmax", "sigmoid", "capacity_probs", "capacity_position", "capacity_padded", "router_fp64"])
def test_alltoall_dispatcher_computes_what_dtgpt_computes(megatron, case):
    moe = CASES[case]
    theirs_layer = build_layer(num_moe_experts=4, **{"moe_router_topk": 2, "moe_token_dispatcher_type": "alltoall", **moe})
    assert type(theirs_layer.token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
    ours_layer, theirs = same_layer_as_megatron(theirs_layer, moe)
    totals = ours_layer.take_totals()
    assert {k: float(totals[k]) for k in theirs.losses} == pytest.approx(theirs.losses, rel=1e-5)
