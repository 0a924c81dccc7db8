"""The GPT model: shapes, parameter count, initialisation, FLOPs formula, gradient accumulation."""

import math
import zlib

import pytest
import torch
import torch.nn as nn

from dtgpt.config import Config, ModelConfig
from dtgpt.config import padded_vocab_size
from dtgpt.model import GPT, Init
from dtgpt.model_size import flops_per_token, num_parameters
from dtgpt.parallel import ParallelDims, build_model_parts
from dtgpt.step import local_forward_backward


def tiny(**kw) -> ModelConfig:
    cfg = ModelConfig(num_layers=3, hidden_size=48, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def materialise(cfg: ModelConfig, vocab: int, seed: int = 7) -> GPT:
    with torch.device("meta"):
        model = GPT(cfg, vocab)
    model.to_empty(device="cpu")
    if model.tied:
        model.output.weight = model.embedding.word.weight
    model.init_weights(seed)
    return model


def test_padded_vocab_is_mesh_free():
    assert padded_vocab_size(50257, 1024) == 51200  # Megatron's 175B rows at tp 8
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(257, 128) == 384


@pytest.mark.parametrize("untie,rope,norm", [(False, False, "LayerNorm"), (True, False, "LayerNorm"), (False, True, "RMSNorm")])
def test_shapes_and_parameter_count(untie, rope, norm):
    cfg = tiny(
        untie_embeddings_and_output_weights=untie,
        position_embedding_type="rope" if rope else "learned_absolute",
        normalization=norm,
    )
    model = materialise(cfg, 64)
    logits = model(torch.randint(0, 64, (2, 16)))
    assert logits.shape == (2, 16, 64)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(cfg, 64)
    assert (model.output.weight is model.embedding.word.weight) == (not untie)


def test_gpt3_175b_parameter_count():
    cfg = ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, max_position_embeddings=2048)
    assert num_parameters(cfg, padded_vocab_size(50257, 1024)) == 174_615_846_912


def test_init_statistics():
    cfg = tiny(num_layers=8, hidden_size=256, init_method_std=0.02)
    model = materialise(cfg, 512)
    std = lambda t: t.float().std().item()  # noqa: E731
    assert std(model.embedding.word.weight) == pytest.approx(0.02, rel=0.02)
    assert std(model.layers["0"].attention.qkv.weight) == pytest.approx(0.02, rel=0.02)
    scaled = 0.02 / math.sqrt(2 * 8)
    assert std(model.layers["3"].attention.proj.weight) == pytest.approx(scaled, rel=0.03)
    assert std(model.layers["3"].mlp.fc2.weight) == pytest.approx(scaled, rel=0.03)
    assert torch.all(model.layers["1"].mlp.fc1.bias == 0)
    assert torch.all(model.layers["1"].input_norm.weight == 1) and torch.all(model.norm.bias == 0)
    assert model.embedding.word.weight.mean().abs() < 1e-3


def _expected_inits(num_layers: int, layer_norm: bool, positions: bool, untied: bool) -> dict[str, Init]:
    """Megatron's GPT init, parameter by parameter: a rename or a changed kind fails the test."""
    N, S, Z, O, E = Init.NORMAL, Init.SCALED_NORMAL, Init.ZEROS, Init.ONES, Init.EMBEDDING
    table = {"embedding.word.weight": E}
    if positions:
        table["embedding.position.weight"] = E
    for i in range(num_layers):
        b = f"layers.{i}."
        table.update({b + "input_norm.weight": O, b + "attention.qkv.weight": N, b + "attention.qkv.bias": Z,
                      b + "attention.proj.weight": S, b + "attention.proj.bias": Z, b + "mlp_norm.weight": O,
                      b + "mlp.fc1.weight": N, b + "mlp.fc1.bias": Z, b + "mlp.fc2.weight": S, b + "mlp.fc2.bias": Z})  # fmt: skip
        if layer_norm:
            table.update({b + "input_norm.bias": Z, b + "mlp_norm.bias": Z})
    table["norm.weight"] = O
    if layer_norm:
        table["norm.bias"] = Z
    if untied:
        table["output.weight"] = N
    return table


@pytest.mark.parametrize("untie,rope,norm", [(False, False, "LayerNorm"), (True, False, "LayerNorm"), (True, True, "RMSNorm")])
def test_modules_declare_megatrons_init(untie, rope, norm):
    cfg = tiny(untie_embeddings_and_output_weights=untie, position_embedding_type="rope" if rope else "learned_absolute", normalization=norm)
    model = materialise(cfg, 64, seed=5)
    expected = _expected_inits(cfg.num_layers, norm == "LayerNorm", not rope, untie)
    assert model.init_kinds() == expected
    # The values are what the seeded draws always gave (the parity references depend on them).
    std = {Init.NORMAL: cfg.init_method_std, Init.EMBEDDING: cfg.init_method_std, Init.SCALED_NORMAL: cfg.init_method_std / math.sqrt(2 * cfg.num_layers)}
    for name, param in model.named_parameters():
        kind = expected[name]
        if kind in std:
            g = torch.Generator().manual_seed((5 * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            want = torch.empty(param.shape).normal_(0.0, std[kind], generator=g)
        else:
            want = torch.full(param.shape, 1.0 if kind is Init.ONES else 0.0)
        assert torch.equal(param, want), name


def test_a_parameter_without_a_declared_init_is_an_error():
    with torch.device("meta"):
        model = GPT(tiny(), 64)
    model.layers["1"].mlp.extra = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"parameter layers\.1\.mlp\.extra\.weight has no declared init"):
        model.init_kinds()


def test_init_is_per_name_and_seeded():
    cfg = tiny()
    a, b, c = materialise(cfg, 64, seed=1), materialise(cfg, 64, seed=1), materialise(cfg, 64, seed=2)
    assert torch.equal(a.layers["2"].mlp.fc1.weight, b.layers["2"].mlp.fc1.weight)
    assert not torch.equal(a.layers["2"].mlp.fc1.weight, c.layers["2"].mlp.fc1.weight)
    # a block's init does not depend on which other blocks exist (pipeline stages drop some)
    deeper = materialise(tiny(num_layers=5), 64, seed=1)
    assert not torch.equal(a.layers["0"].mlp.fc1.weight, a.layers["1"].mlp.fc1.weight)
    assert torch.equal(a.layers["2"].attention.qkv.weight, deeper.layers["2"].attention.qkv.weight)


def test_flops_per_token_is_megatron_formula():
    cfg = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048)
    L, h, s, V = 24, 2048, 2048, 50304
    classic = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert flops_per_token(cfg, V) == pytest.approx(classic, rel=1e-12)


def _grads_after(cfg: Config, batch, n_micro):
    dims = ParallelDims.from_config(cfg, 1)
    with torch.device("meta"):
        whole = GPT(cfg.model, 64)
    model = build_model_parts(cfg, dims, whole, torch.device("cpu"))
    loss = local_forward_backward(model, batch, n_micro)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, model.parts[0]


def test_gradient_accumulation_equivalence():
    """Global batch 8 as 1 x 8 or 8 x 1 micro-batches: the same loss and gradients (fp32)."""
    cfg = Config()
    cfg.model = tiny()
    cfg.data.mock_data = True
    batch = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    loss1, grads1, model = _grads_after(cfg, batch, 1)
    loss8, grads8, _ = _grads_after(cfg, batch, 8)
    assert loss1.item() == pytest.approx(loss8.item(), rel=1e-6)
    for name in grads1:
        torch.testing.assert_close(grads8[name], grads1[name], rtol=1e-6, atol=1e-6, msg=name)
    # the loss is the global-batch mean token loss, not a mean of micro-batch means
    with torch.no_grad():
        plain = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    assert loss1.item() == pytest.approx(plain.item(), rel=1e-6)
