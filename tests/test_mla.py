"""dtgpt's multi-latent attention (dtgpt/mla.py) against megatron-core's MLASelfAttention from its
local layer spec, on CPU in the test process (the patches of tests/megatron_moe.py): the same
weights (the parameter names are Megatron's) and inputs give the same output, input gradient
and weight gradients, with and without the compressed query, the norms and YaRN.

One more patch: megatron-core 0.16.1's local core attention (DotProductAttention) does not take
the k_channels / v_channels keywords MLASelfAttention passes it (only Transformer Engine's
does), so the spec gets a subclass that drops them; its numerics are DotProductAttention's own
(the softmax scale MLA passes, baddbmm, softmax, bmm), with config.kv_channels = v_head_dim for
the shape of its output. And its module's HAVE_TE is set False: the adapter module imports
without Transformer Engine, leaving TELinear None for an isinstance check."""

import pytest
import torch

from dtgpt.config import Config, ConfigError, ModelConfig, validate
from dtgpt.mla import MLASelfAttention
from dtgpt.model import GPT, CoreAttention
from tests.megatron_moe import megatron_session

HIDDEN, HEADS, SEQ, BATCH = 32, 4, 12, 2
SHAPE = dict(kv_lora_rank=12, qk_head_dim=10, qk_pos_emb_head_dim=8, v_head_dim=6)
CASES = {
    # DeepSeek-V3's kind: compressed query, norms on the compressed vectors, YaRN with its own
    # attention factor (mscale != mscale_all_dim) and a softmax scale (mscale_all_dim)
    "yarn": dict(q_lora_rank=16, qk_layernorm=True, normalization="RMSNorm", rope_type="yarn",
                 rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=4096),
    # DeepSeek-V2-Lite's kind: the query projected in one, no norms, plain RoPE, LayerNorm, a bias on the output
    "rope": dict(q_lora_rank=None, qk_layernorm=False, normalization="LayerNorm", rope_type="rope", add_bias_linear=True),
}  # fmt: skip


@pytest.fixture
def megatron(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import multi_latent_attention

    # Its module sees Transformer Engine's adapter import without Transformer Engine (TELinear None)
    monkeypatch.setattr(multi_latent_attention, "HAVE_TE", False)
    yield from megatron_session(monkeypatch)


def _core_without_channels():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CoreWithoutChannels(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return CoreWithoutChannels


def megatron_mla(case: dict):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, kv_channels=SHAPE["v_head_dim"],
        **{"add_bias_linear": False, **SHAPE, **case},
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=case["qk_layernorm"],
                                    normalization=case["normalization"])  # fmt: skip
    spec.submodules.self_attention.submodules.core_attention = _core_without_channels()
    torch.manual_seed(5)
    layer = build_module(spec.submodules.self_attention, config=config, layer_number=1)
    with torch.no_grad():  # weights large enough that a mix-up shows; norms away from one
        for name, p in layer.named_parameters():
            p.uniform_(0.5, 1.5) if "layernorm" in name else p.normal_(0.0, 0.3)
    return layer


def dtgpt_mla(case: dict) -> MLASelfAttention:
    cfg = ModelConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, multi_latent_attention=True,
        position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
        **{"add_bias_linear": False, **SHAPE, **case},
    )  # fmt: skip
    return MLASelfAttention(cfg, CoreAttention(cfg))


@pytest.mark.parametrize("case", sorted(CASES))
def test_mla_matches_megatron(megatron, case):
    theirs = megatron_mla(CASES[case])
    ours = dtgpt_mla(CASES[case])
    params = dict(theirs.named_parameters())
    assert sorted(params) == sorted(n for n, _ in ours.named_parameters()), "Megatron's parameter names"
    ours.load_state_dict({n: p.detach() for n, p in params.items()})
    g = torch.Generator().manual_seed(3)
    x, upstream = torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)

    x_theirs = x.transpose(0, 1).clone().requires_grad_(True)  # Megatron's (T, B, h)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    out, bias = theirs(x_theirs, mask)
    out = out + bias if bias is not None else out
    (out * upstream.transpose(0, 1)).sum().backward()

    x_ours = x.clone().requires_grad_(True)
    y = ours(x_ours)
    (y * upstream).sum().backward()
    torch.testing.assert_close(y, out.detach().transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad.transpose(0, 1), rtol=1e-5, atol=1e-5)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_yarn_changes_what_attention_computes():
    """The YaRN keys are read: the "yarn" case differs from the same weights with rope_type='rope'."""
    torch.manual_seed(0)
    yarn = dtgpt_mla(CASES["yarn"])
    rope = dtgpt_mla({**CASES["yarn"], "rope_type": "rope"})
    rope.load_state_dict(yarn.state_dict())
    x = torch.randn(BATCH, SEQ, HIDDEN)
    assert not torch.allclose(yarn(x), rope(x), atol=1e-4)


def test_gpt_trains_with_mla():
    cfg = ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, multi_latent_attention=True,
                      position_embedding_type="rope", **SHAPE, **CASES["yarn"])  # fmt: skip
    model = GPT(cfg, 64)
    model.init_weights(seed=1)
    tokens = torch.randint(0, 64, (BATCH, SEQ))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


BAD = {
    "model.group_query_attention=true": dict(group_query_attention=True, num_query_groups=2),
    "position_embedding_type='rope'": dict(position_embedding_type="learned_absolute"),
    "model.qk_pos_emb_head_dim=7": dict(qk_pos_emb_head_dim=7),
    "model.kv_lora_rank=0": dict(kv_lora_rank=0),
    "model.q_lora_rank=0": dict(q_lora_rank=0),
    "model.rotary_interleaved=True": dict(rotary_interleaved=True),
    "model.rope_type='ntk'": dict(rope_type="ntk"),
}


@pytest.mark.parametrize("expected", sorted(BAD))
def test_bad_mla_config_is_one_line(expected):
    cfg = Config()
    for key, value in {"multi_latent_attention": True, "position_embedding_type": "rope", **BAD[expected]}.items():
        setattr(cfg.model, key, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expected in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key, value", [("rope_type", "yarn"), ("q_lora_rank", 16), ("rotary_scaling_factor", 40.0),
                                        ("mscale_all_dim", 1.0), ("kv_lora_rank", 64)])
def test_latent_keys_need_multi_latent_attention(key, value):
    """Set without model.multi_latent_attention they would change nothing: refused, not ignored."""
    cfg = Config()
    setattr(cfg.model, key, value)
    with pytest.raises(ConfigError, match=f"model.{key}=.* needs model.multi_latent_attention=true") as err:
        validate(cfg)
    assert "\n" not in str(err.value)


def test_checkpoint_formats_refuse_mla_in_one_line():
    """No Hugging Face layout is written for a dense MLA model (DeepseekV3ForCausalLM needs MoE
    blocks): refused by name (Megatron's torch_dist and per-rank files are written:
    tests/test_megatron_mla_checkpoint.py; DeepSeek-V3 with experts: tests/test_hf_deepseek.py)."""
    from dtgpt.checkpoint.export import hf_layout_for

    cfg = ModelConfig(multi_latent_attention=True, position_embedding_type="rope")
    with pytest.raises(ValueError, match="model.multi_latent_attention=false.*DeepseekV3ForCausalLM needs .*model.num_experts") as err:
        hf_layout_for(cfg)
    assert "\n" not in str(err.value)
