"""Megatron's fp16/bf16 regime in one process (dtgpt/parallel/compute_copy.py).

The model computes in the low-precision dtype over fp32 master weights: in one process a
compute-dtype copy of the fp32 masters runs (FSDP's cast on several ranks), so the model dtgpt
runs must be exactly the plain model cast to bf16, its gradients must land on the fp32 masters,
and Megatron's switches (fp32_residual_connection, fp16_lm_cross_entropy) must do what they say.
That copy against FSDP's cast at one rank, bit for bit: test_compute_copy.py. Layouts against one process: test_parity_precision.py;
the dtype of every collective: test_comm_counts.py; megatron-core's Float16Module:
test_megatron_checkpoint.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dtgpt
from dtgpt.config import padded_vocabulary
from dtgpt.model import GPT

VOCAB = 32
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)


def built(**training):
    """(cfg, model parts) of the tiny GPT in one process."""
    cfg = dtgpt.make_config(
        model=MODEL,
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        training=dict(micro_batch_size=2, global_batch_size=4, train_iters=1, **training),
    )
    runtime = dtgpt.init_distributed(cfg)
    return cfg, dtgpt.build_model(cfg, runtime, vocab_size=VOCAB)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, MODEL["seq_length"]), generator=torch.Generator().manual_seed(0))


def test_bf16_model_is_the_plain_model_in_bf16_over_fp32_masters():
    try:
        cfg, model = built(bf16=True)
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters
        with torch.no_grad():
            ours = model.forward_module()(tokens())
        plain = GPT(cfg.model, padded_vocabulary(cfg, VOCAB))
        plain.init_weights(cfg.training.seed)
        with torch.no_grad():
            theirs = plain.to(torch.bfloat16)(tokens())
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
        batch = next(dtgpt.build_train_iterator(cfg, model))
        loss = dtgpt.forward_backward(model, batch, 2)
        assert isinstance(loss, float)
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)
    finally:
        dtgpt.shutdown()


def test_fp32_residual_connection_keeps_the_stream_in_fp32():
    try:
        _, model = built(bf16=True, fp32_residual_connection=True)
        part = model.forward_module()
        seen = {}
        part.layers["1"].register_forward_hook(lambda m, args, out: seen.update(block_in=args[0].dtype, block_out=out.dtype))
        with torch.no_grad():
            logits = part(tokens())
        assert seen == {"block_in": torch.float32, "block_out": torch.float32}
        assert logits.dtype == torch.bfloat16  # the final norm returns the compute dtype
    finally:
        dtgpt.shutdown()


def test_fp16_lm_cross_entropy_takes_the_logits_as_they_are():
    logits = torch.randn(2, 16, VOCAB, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    labels = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    in_fp32 = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    in_fp16 = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").float().sum()
    assert in_fp32 != in_fp16  # the test can tell them apart
    for flag, expected in ((False, in_fp32), (True, in_fp16)):
        try:
            _, model = built(fp16=True, fp16_lm_cross_entropy=flag)
            assert model.cross_entropy(logits, labels) == expected
        finally:
            dtgpt.shutdown()


def test_a_compiled_run_rounds_each_token_loss_as_eager_does():
    """training.compile with fp16_lm_cross_entropy: the loss is eager's to the bit (compiled,
    inductor kept fp32 between ops and skipped the rounding of each token's loss: 195.045 here
    against eager's 194.875; its emulate_precision_casts did not restore it on torch 2.11)."""
    from dtgpt.parallel.model_parts import build_cross_entropy, low_precision_cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 8, 1000, generator=g)).bfloat16()
    labels = torch.randint(0, 1000, (2, 8), generator=g)
    eager = low_precision_cross_entropy_sum(logits, labels)
    assert build_cross_entropy(compiled=True, in_fp32=False)(logits, labels) == eager
