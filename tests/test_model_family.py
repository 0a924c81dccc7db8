"""The GPT family's options, piece by piece: RoPE against megatron-core's own functions, norms
with gamma stored as gamma - 1, grouped-query attention, and the size formulas.

megatron-core's RoPE code runs in this process on CPU (its RotaryEmbedding with
use_cpu_initialization and the unfused apply function need no patch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from dtgpt.config import ConfigError, ModelConfig, load_config
from dtgpt.model import GPT, attend
from dtgpt.norms import LayerNorm, RMSNorm
from dtgpt.rope import apply_rotary, rotary_frequencies
from dtgpt.model_size import flops_per_token, num_parameters

HEAD_DIM, SEQ = 32, 24


def megatron_rope(x: torch.Tensor, percent: float, interleaved: bool, scaling: bool) -> torch.Tensor:
    """megatron-core's RoPE of x (B, T, nh, hd), through its [T, B, nh, hd] layout."""
    rope = RotaryEmbedding(HEAD_DIM, percent, rotary_interleaved=interleaved, rotary_base=10000, rope_scaling=scaling,
                           use_cpu_initialization=True)  # fmt: skip
    out = _apply_rotary_pos_emb_bshd(x.transpose(0, 1), rope.get_emb(x.shape[1]), rotary_interleaved=interleaved)
    return out.transpose(0, 1)


@pytest.mark.parametrize("percent", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scaling", [False, True])
def test_rope_is_megatrons(percent, interleaved, scaling, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where get_emb puts its angles
    cfg = ModelConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, position_embedding_type="rope",
                      rotary_percent=percent, rotary_interleaved=interleaved, use_rope_scaling=scaling)  # fmt: skip
    x = torch.randn(2, SEQ, 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    ours = apply_rotary(x, rotary_frequencies(cfg), interleaved=interleaved)
    torch.testing.assert_close(ours, megatron_rope(x, percent, interleaved, scaling), rtol=1e-6, atol=1e-6)
    if percent < 1.0:  # the channels past the rotated ones pass unchanged
        assert torch.equal(ours[..., int(HEAD_DIM * percent):], x[..., int(HEAD_DIM * percent):])


def test_llama31_scaling_slows_only_the_long_wavelengths():
    cfg = dict(hidden_size=4 * 128, num_attention_heads=4, position_embedding_type="rope", rotary_base=500000)
    plain, scaled = rotary_frequencies(ModelConfig(**cfg)), rotary_frequencies(ModelConfig(**cfg, use_rope_scaling=True))
    wavelength = 2 * torch.pi / plain
    assert torch.equal(scaled[wavelength < 8192 / 4], plain[wavelength < 8192 / 4])
    torch.testing.assert_close(scaled[wavelength > 8192], plain[wavelength > 8192] / 8)


@pytest.mark.parametrize("norm", [LayerNorm, RMSNorm])
def test_a_norm_with_gamma_stored_minus_one_is_the_norm_with_gamma(norm):
    x = torch.randn(4, 16)
    stored, plain = norm(16, eps=1e-5, one_plus=True), norm(16, eps=1e-5)
    with torch.no_grad():
        stored.weight.uniform_(-0.5, 0.5)
        plain.weight.copy_(stored.weight + 1)
        if norm is LayerNorm:
            plain.bias.copy_(stored.bias.uniform_(-0.5, 0.5))
    torch.testing.assert_close(stored(x), plain(x), rtol=0, atol=0)


def test_apply_layernorm_1p_starts_every_norm_at_zero_and_the_model_at_identity_norms():
    cfg = load_config(None, ["--model.apply_layernorm_1p=true", "--model.qk_layernorm=true", "--data.mock_data=true"])
    model = GPT(cfg.model, 128)
    model.init_weights(0)
    norms = {n: p for n, p in model.named_parameters() if "norm" in n and n.endswith("weight")}
    assert len(norms) == 4 * cfg.model.num_layers + 1 and all(torch.equal(p, torch.zeros_like(p)) for p in norms.values())


def test_grouped_query_attention_shares_each_key_value_head_with_its_groups_queries():
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(attend(q, k, v), expected)


FAMILY = {
    "gpt3": [],
    "llama": ["--model.normalization=RMSNorm", "--model.swiglu=true", "--model.add_bias_linear=false",
              "--model.group_query_attention=true", "--model.num_query_groups=2", "--model.position_embedding_type=rope",
              "--model.untie_embeddings_and_output_weights=true"],
    "options": ["--model.kv_channels=8", "--model.qk_layernorm=true", "--model.add_bias_linear=false",
                "--model.add_qkv_bias=true", "--model.ffn_hidden_size=96"],
    "sinks": ["--model.softmax_type=learnable"],  # a learned logit per head and block
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILY)
def test_parameter_count_and_flops_follow_the_architecture(family):
    cfg = load_config(None, ["--data.mock_data=true", *FAMILY[family]]).model
    model = GPT(cfg, 128)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(cfg, 128)
    # Megatron's count: 12 h^2 per token-layer for (1 + groups/heads + s/h) x query width / h of
    # attention and ffn/h (x 3/2 for SwiGLU) of MLP, plus the logits' 6 h V
    h, s, nh, ng = cfg.hidden_size, cfg.seq_length, cfg.num_attention_heads, cfg.query_groups
    attention = (1 + ng / nh + s / h) * nh * cfg.head_dim / h
    mlp = cfg.ffn_size / h * (1.5 if cfg.swiglu else 1)
    assert flops_per_token(cfg, 128) == pytest.approx(12 * h * h * cfg.num_layers * (attention + mlp) + 6 * h * 128)


def test_swiglu_width_defaults_to_megatrons():
    assert ModelConfig(hidden_size=4096, swiglu=True).ffn_size == 10880  # int(8/3 * 4096 / 64) * 64
    assert ModelConfig(hidden_size=4096).ffn_size == 16384


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--model.group_query_attention=true", "--model.num_query_groups=3"], "model.num_query_groups=3 must divide model.num_attention_heads=4"),
        (["--model.num_attention_heads=6", "--model.hidden_size=48", "--model.group_query_attention=true", "--model.num_query_groups=3",
          "--parallel.tensor_model_parallel_size=2"],
         "parallel.tensor_model_parallel_size=2 and model.num_query_groups=3 must divide one another"),
        (["--model.group_query_attention=true", "--model.num_query_groups=2", "--parallel.tensor_model_parallel_size=4",
          "--model.qk_layernorm=true"], "model.qk_layernorm=true needs model.num_query_groups=2 >= parallel.tensor_model_parallel_size=4"),
        (["--model.position_embedding_type=rope", "--model.rotary_percent=0"], "model.rotary_percent=0.0 must be in (0, 1]"),
        (["--model.position_embedding_type=rope", "--model.rotary_percent=0.1"], "rotates rotary_percent * head size = 1 channels"),
        (["--model.kv_channels=-1"], "model.kv_channels=-1 must be >= 0"),
        (["--model.hidden_size=66"], "model.num_attention_heads=4 must divide model.hidden_size=66 (or set model.kv_channels)"),
    ],
)  # fmt: skip
def test_family_options_are_checked_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--data.mock_data=true", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)
