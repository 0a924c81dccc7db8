"""megatron-core's MoE layer on CPU, in the test process: the oracle for dtgpt/moe (the dev
extra's megatron-core: 0.19.2, or 0.16.1 below Python 3.12).

Its MoELayer from the local layer spec (SequentialMLP experts, the allgather dispatcher unless a
test names another) runs on one gloo rank (a HashStore, no rendezvous) with patches of what it
assumes of CUDA, none of its numerics: the CUDA RNG tracker's fork a null context (draws come from
torch's default generator), torch.cuda.current_device -> "cpu", torch.cuda.synchronize a no-op,
moe_utils.te_general_gemm = None (a NameError without Transformer Engine), and the alltoall
dispatcher's host copy of its split sizes (a CUDA side stream) the identity. `megatron_session` (for a test's fixture) applies them through monkeypatch,
so they end with the test, and destroys Megatron's groups and the process group after it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

HIDDEN, FFN, SEQ, BATCH = 16, 24, 6, 3


@dataclass
class MegatronRun:
    """What megatron-core's layer did with one input: its router's and its layer's outputs."""

    probs: torch.Tensor
    routing_map: torch.Tensor
    output: torch.Tensor
    losses: dict[str, float]
    """Megatron's tracker: name -> the loss without its coefficient (this one layer)."""
    router_grad: torch.Tensor
    input_grad: torch.Tensor


def megatron_session(monkeypatch):
    """A generator for a fixture: patch, start one gloo rank and Megatron's groups, yield, tear down."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(megatron_random.CudaRNGStatesTracker, "fork", lambda self, *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    # The alltoall dispatcher copies its split sizes to the host on a CUDA side stream; on CPU
    # they are on the host already: its copy-and-wait step returns the counts as they are.
    monkeypatch.setattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
    monkeypatch.setattr(
        token_dispatcher.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize",
        lambda self, point, tokens_per_expert=None: tokens_per_expert,
    )  # fmt: skip
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_layer(**moe):
    """megatron-core's MoELayer (local spec) for `moe` TransformerConfig fields, weights drawn
    at its init from a fixed seed."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, **{"moe_token_dispatcher_type": "allgather", **moe},
    )  # fmt: skip
    mlp = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False).submodules.mlp
    torch.manual_seed(7)
    # megatron-core 0.16's layer spec holds a ModuleSpec for the MoE layer; 0.19's holds the
    # layer's builder, functools.partial(MoELayer, submodules=...)
    layer = mlp(config) if isinstance(mlp, functools.partial) else MoELayer(config, mlp.submodules)
    layer.set_layer_number(1)  # the router logs its losses only with one (the transformer layer sets it)
    with torch.no_grad():  # a spread of logits, so that routing and the losses are far from uniform
        layer.router.weight.normal_(0.0, 0.5)
    return layer


def run_megatron(layer, x: torch.Tensor, upstream: torch.Tensor) -> MegatronRun:
    """Forward x (B, T, h) batch-first (Megatron's is (T, B, h)), backward (output * upstream).sum()."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    clear_aux_losses_tracker()
    layer.zero_grad(set_to_none=True)
    hidden = x.transpose(0, 1).contiguous().requires_grad_(True)
    captured = {}
    router_forward = layer.router.forward

    def capture(*args, **kwargs):
        captured["probs"], captured["map"] = out = router_forward(*args, **kwargs)
        return out

    layer.router.forward = capture
    try:
        output, _ = layer(hidden)
    finally:
        layer.router.forward = router_forward
    (output * upstream.transpose(0, 1)).sum().backward()
    losses = {name: float(entry["values"][0]) for name, entry in get_moe_layer_wise_logging_tracker().items()}
    clear_aux_losses_tracker()
    return MegatronRun(
        probs=captured["probs"].detach(), routing_map=captured["map"], output=output.detach().transpose(0, 1),
        losses={k: v for k, v in losses.items() if v != 0.0}, router_grad=layer.router.weight.grad.clone(),
        input_grad=hidden.grad.transpose(0, 1).clone(),
    )  # fmt: skip


def expert_weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """SequentialMLP's per-expert linear_fc1 / linear_fc2 weights stacked: (E, ffn', h), (E, h, ffn)."""
    experts = layer.experts.local_experts
    fc1 = torch.stack([e.linear_fc1.weight.detach() for e in experts])
    fc2 = torch.stack([e.linear_fc2.weight.detach() for e in experts])
    return fc1, fc2
