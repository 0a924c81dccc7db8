"""The compute copy of one process (dtgpt/parallel/compute_copy.py) against FSDP's cast at one rank.

Both are Megatron's regime (bf16 compute over fp32 masters, gradients accumulated in fp32); the
copy must give FSDP's numbers bit for bit: the losses, gradient norms and every master weight
over three iterations of two micro-batches each, and checkpoints that either side reads from the
other (mesh-free: FSDP's DTensors of one rank and the copy's plain masters store the same thing).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

import dtgpt
from dtgpt.distributed import init_one_rank_group
from dtgpt.model import GPT
from dtgpt.parallel import ModelParts, materialize
from dtgpt.parallel.fsdp import apply_fsdp, mixed_precision_policy
from dtgpt.plan.memory import state_bytes
from dtgpt.state import build_train_state

VOCAB = 64
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)


def config(**training):
    return dtgpt.make_config(
        model=MODEL,
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        training=dict(micro_batch_size=2, global_batch_size=4, train_iters=3, **training),
        optimizer=dict(lr=1e-2, lr_decay_style="constant", clip_grad=0.05),  # clipping on: its path is compared too
    )


def fsdp_model(cfg, reference: ModelParts) -> ModelParts:
    """The tiny GPT as dtgpt ran fp16/bf16 in one process before the compute copy: FSDP of one
    rank (a process group of one), its MixedPrecisionPolicy the cast."""
    init_one_rank_group(cfg, torch.device("cpu"))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = GPT(cfg.model, reference.parts[0].vocab_size)
    reduce = torch.float32 if cfg.training.bf16 or cfg.training.accumulate_allreduce_grads_in_fp32 else torch.float16
    apply_fsdp(model, mesh, mixed_precision_policy(torch.bfloat16 if cfg.training.bf16 else torch.float16, reduce), reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    materialize(model, cfg, torch.device("cpu"))
    return dataclasses.replace(reference, parts=[model], compute_copies=(), grad_reduce_dtype=reduce)


def weights(state) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.model.named_parameters()}


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
def test_compute_copy_is_fsdp_of_one_rank_bit_for_bit(precision):
    # fp16 without accumulate_allreduce_grads_in_fp32: gradients accumulate in fp16 (Megatron's default there).
    cfg = config(**{precision: True})
    cfg.optimizer.initial_loss_scale = 1024.0  # fp16: no overflow, so every step is compared
    try:
        runtime = dtgpt.init_distributed(cfg)
        assert not dist.is_initialized()  # no process group: nothing of FSDP's runs
        ours = build_train_state(cfg, dtgpt.build_model(cfg, runtime, VOCAB))
        assert ours.model.compute_copy is not None
        theirs = build_train_state(cfg, fsdp_model(cfg, ours.model))
        assert weights(ours).keys() == weights(theirs).keys()
        assert all(torch.equal(weights(ours)[k], v) for k, v in weights(theirs).items())
        batches = dtgpt.build_train_iterator(cfg, ours.model)
        for _ in range(cfg.training.train_iters):
            batch = next(batches)
            a, b = dtgpt.train_step(cfg, ours, batch), dtgpt.train_step(cfg, theirs, batch)
            assert (a.loss, a.grad_norm, a.skipped) == (b.loss, b.grad_norm, b.skipped)
            assert a.grad_norm > cfg.optimizer.clip_grad
        copy = ours.model.compute_copy
        held = {"params": copy.master_flat, "copies": copy.flat, "grads": (copy.master_grad_flat, copy.grad_flat),
                "adam": [t for s in ours.optimizer.optimizers[0].state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]}
        n = copy.master_flat.numel()
        planned = state_bytes(n, n, 0, compute_bytes=2, grad_bytes=4, fsdp=True, pipelined=False,
                              reshard_after_forward=False, compute_copy=True)  # fmt: skip
        for term, tensors in held.items():  # the planner counts what the copy holds
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
            assert getattr(planned, term) == sum(t.numel() * t.element_size() for t in tensors), term
        mine, fsdp = weights(ours), weights(theirs)
        assert all(torch.equal(mine[k], v) for k, v in fsdp.items()), [k for k, v in fsdp.items() if not torch.equal(mine[k], v)]
        assert not all(torch.equal(mine[k], v) for k, v in weights(build_train_state(cfg, dtgpt.build_model(cfg, runtime, VOCAB))).items())
    finally:
        dtgpt.shutdown(clean=False)


@pytest.mark.slow
def test_checkpoints_cross_between_the_copy_and_fsdp(tmp_path):
    """Saved by one, loaded by the other: the same weights, optimizer state and next step; and
    the compute copy runs the loaded weights (a load writes the masters in place)."""
    cfg = config(bf16=True)
    try:
        runtime = dtgpt.init_distributed(cfg)
        ours = build_train_state(cfg, dtgpt.build_model(cfg, runtime, VOCAB))
        theirs = build_train_state(cfg, fsdp_model(cfg, ours.model))
        batches = dtgpt.build_train_iterator(cfg, ours.model)
        first, second = next(batches), next(batches)
        dtgpt.train_step(cfg, ours, first)  # only ours trains: the loads below must bring theirs along
        dtgpt.save_checkpoint(tmp_path / "ours", cfg, runtime, ours)
        dtgpt.load_checkpoint(tmp_path / "ours", cfg, runtime, theirs)
        assert all(torch.equal(weights(ours)[k], v) for k, v in weights(theirs).items())
        a, b = dtgpt.train_step(cfg, ours, second), dtgpt.train_step(cfg, theirs, second)
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)

        fresh = build_train_state(cfg, dtgpt.build_model(cfg, runtime, VOCAB))
        dtgpt.save_checkpoint(tmp_path / "theirs", cfg, runtime, theirs)
        dtgpt.load_checkpoint(tmp_path / "theirs", cfg, runtime, fresh)
        third = next(batches)
        a, b = dtgpt.train_step(cfg, fresh, third), dtgpt.train_step(cfg, theirs, third)
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
        assert all(torch.equal(weights(fresh)[k], v) for k, v in weights(theirs).items())
    finally:
        dtgpt.shutdown(clean=False)
