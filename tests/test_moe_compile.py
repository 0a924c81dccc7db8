"""An MoE layer with a capacity factor, compiled (inductor, as training.compile compiles a block),
gives eager's output and gradients: the router's through the probabilities, the experts', the
input's (fp32, 1e-5). Padded to capacity (static shapes) and dropping without padding."""

from __future__ import annotations

import copy

import pytest
import torch

import dtgpt
from dtgpt.moe.layer import MoELayer

pytestmark = pytest.mark.slow  # two inductor compiles


@pytest.mark.parametrize("pad", [True, False], ids=["padded", "dropping"])
def test_compiled_moe_layer_with_capacity_matches_eager(pad):
    torch.manual_seed(0)
    model = dict(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=16, num_experts=4, moe_router_topk=2,
                 moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                 moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=pad)  # fmt: skip
    cfg = dtgpt.make_config(model=model, data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100),
                            training=dict(micro_batch_size=2, global_batch_size=2, compile=True))  # fmt: skip
    eager = MoELayer(cfg.model)
    for param in eager.parameters():
        torch.nn.init.normal_(param, std=0.2)
    compiled = copy.deepcopy(eager)
    compiled.compile(dynamic=False)
    x = torch.randn(2, 16, 16)
    results = []
    for layer in (eager, compiled):
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.square().sum().backward()
        results.append({"out": out.detach(), "input": inputs.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    want, got = results
    assert want.keys() == got.keys() and "router.weight" in want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5 * want[name].abs().max().item(), msg=name)
