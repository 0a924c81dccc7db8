"""Sliding-window attention, attention sinks (softmax_type) and the clamped, offset SwiGLU against
megatron-core's GPTModel (local layer spec), on CPU in the test process (the patches of
tests/megatron_moe.py): the same weights (every name mapped by Megatron's key map, the learnable
sink's included) and tokens give the same logits, loss and gradient of every parameter.

One more patch: megatron-core builds its sliding-window mask with device="cuda"
(transformer.utils.get_sliding_window_causal_mask); its module sees a torch whose `ones` drops
that device, nothing else changed. Megatron's local path masks with -10000 instead of -inf and
replaces the causal mask by the band [i - left, i]: the same probabilities in fp32.
Plus the config rules, one line each, and the window pattern of window_attn_skip_freq.
"""

import pytest
import torch
import torch.nn.functional as F

from dtgpt.config import Config, ConfigError, ModelConfig, load_config, validate
from dtgpt.model import GPT
from tests.megatron_moe import megatron_session
from tests.test_mtp import BATCH, FFN, HEADS, HIDDEN, SEQ, VOCAB, take_megatron_weights

LAYERS, WINDOW = 4, 3
CASES = {
    # gpt-oss's attention: a 3-token window in blocks 1 and 3 (from 1), full in 2 and 4, learned sinks
    "window_learnable_sink": dict(window_size=(WINDOW, 0), window_attn_skip_freq=2, softmax_type="learnable"),
    "window_pattern_off_by_one": dict(window_size=(WINDOW, 0), window_attn_skip_freq=[0, 1, 1, 0], softmax_type="off-by-one"),
    "clamped_swiglu": dict(glu_linear_offset=1.0, activation_func_clamp_value=0.5),
}  # fmt: skip


class _CpuTorch:
    """torch as megatron-core's transformer.utils sees it: `ones` on the CPU whatever device it names."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def ones(*size, device=None, **kwargs):
        return torch.ones(*size, **kwargs)


@pytest.fixture
def megatron(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import utils

    monkeypatch.setattr(utils, "torch", _CpuTorch())
    yield from megatron_session(monkeypatch)


def megatron_gpt(case: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_activation_fusion=False, persist_layer_norm=False,
        **case,
    )  # fmt: skip
    torch.manual_seed(7)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)  # fmt: skip
    with torch.no_grad():  # norms away from one, weights large enough that a mix-up shows, sinks near the scores
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 1.0 if "softmax_offset" in name else 0.2)
    return model


def dtgpt_cfg(case: dict) -> ModelConfig:
    variants = {**case, "window_size": list(case["window_size"])} if "window_size" in case else case
    if isinstance(variants.get("window_attn_skip_freq"), list):
        variants["window_attn_skip_freq"] = str(variants["window_attn_skip_freq"])
    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                       normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                       untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, **variants)  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_variant_matches_megatron(megatron, case):
    theirs, ours = megatron_gpt(CASES[case]), GPT(dtgpt_cfg(CASES[case]), VOCAB)
    params, mapped = take_megatron_weights(ours, theirs)
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)

    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    logits_theirs = theirs(tokens, positions, causal)  # (B, T, V)
    loss_theirs = F.cross_entropy(logits_theirs.flatten(0, 1), labels.flatten())
    loss_theirs.backward()
    logits_ours = ours(tokens)
    loss_ours = F.cross_entropy(logits_ours.flatten(0, 1), labels.flatten())
    loss_ours.backward()

    torch.testing.assert_close(logits_ours, logits_theirs.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_ours, loss_theirs.detach(), rtol=1e-6, atol=1e-6)
    for name, p in ours.named_parameters():
        key, rows = mapped[name]
        torch.testing.assert_close(p.grad, params[key].grad[rows], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
