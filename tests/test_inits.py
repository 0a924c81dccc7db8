"""Initialisation by region (dtgpt.inits.fill_draw): a rank draws its shard of a parameter a
chunk at a time, and gets exactly the values of the one full draw (named_draw); and Megatron's
init methods (--init-method-xavier-uniform, --embedding-init-method-std) against megatron-core's
TransformerConfig, which resolves them."""

from __future__ import annotations

import random
import re
import warnings

import pytest
import torch

from dtgpt.config import ModelConfig
from dtgpt.inits import Draw, Init, fill_draw, named_draw, xavier_bound
from tests.test_model import materialise, tiny

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes on its absent GPU kernels
    from megatron.core.transformer.transformer_config import TransformerConfig


def chunked_draw(n: int, block: int, seed: int = 5) -> torch.Tensor:
    """normal_ in draws of `block` (a multiple of 16) and a last one of at least 16."""
    generator, out, done = torch.Generator().manual_seed(seed), [], 0
    while done < n:
        take = n - done if n - done < block + 16 else block
        out.append(torch.empty(take).normal_(0.0, 0.02, generator=generator))
        done += take
    return torch.cat(out)


@pytest.mark.parametrize("n", [16, 17, 31, 32, 47, 100, 255, 1000, 4097])
@pytest.mark.parametrize("block", [16, 48, 256])
def test_cpu_normal_drawn_in_aligned_pieces_equals_one_draw(n, block):
    """The property fill_normal rests on (torch's CPU normal_ transforms 16 uniforms at a time,
    above and below its vectorised sizes): if torch changes it, this fails first."""
    whole = torch.empty(n).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(5))
    assert torch.equal(chunked_draw(n, block), whole)


@pytest.mark.parametrize("n", [5, 17, 1000, 4097])
@pytest.mark.parametrize("block", [1, 3, 16, 256])
def test_cpu_uniform_drawn_in_any_pieces_equals_one_draw(n, block):
    """The property fill_draw's uniform draws rest on: uniform_ consumes the generator element by element."""
    pieces, generator = [], torch.Generator().manual_seed(5)
    for start in range(0, n, block):
        pieces.append(torch.empty(min(block, n - start)).uniform_(-0.1, 0.1, generator=generator))
    assert torch.equal(torch.cat(pieces), torch.empty(n).uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("draw", [Draw(0.02), Draw(0.05, uniform=True)], ids=["normal", "uniform"])
@pytest.mark.parametrize("shape", [(1000, 64), (37,), (5000,), (3, 40, 50), (4, 48, 16), (7, 9, 11, 13)])
@pytest.mark.parametrize("chunk", [48, 1024, 1 << 16])
def test_any_region_is_the_full_draws_region(shape, chunk, draw):
    full = named_draw("layers.0.w", shape, draw, 3, torch.device("cpu"))
    rng = random.Random(hash((shape, chunk)) & 0xFFFF)
    for _ in range(4):
        offsets = [rng.randrange(d) for d in shape]
        sizes = [rng.randint(1, d - o) for d, o in zip(shape, offsets)]
        out = torch.empty(sizes)
        fill_draw(out, "layers.0.w", shape, offsets, draw, 3, chunk=chunk)
        assert torch.equal(out, full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]), (offsets, sizes)



def megatron_methods(cfg: ModelConfig) -> dict[Init, object]:
    """megatron-core's TransformerConfig resolving its init methods as Megatron-LM's arguments
    give them: --init-method-xavier-uniform passes torch's xavier_uniform_ as init_method and as
    the output layers' method, --embedding-init-method-std its std. GPTModel draws the embeddings
    with embedding_init_method, qkv, fc1 and an untied output layer with init_method, the
    projections into the residual stream with output_layer_init_method."""
    xavier = torch.nn.init.xavier_uniform_ if cfg.init_method_xavier_uniform else None
    config = TransformerConfig(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                               init_method_std=cfg.init_method_std, embedding_init_method_std=cfg.embedding_init_method_std,
                               init_method=xavier, output_layer_init_method=xavier)  # fmt: skip
    return {Init.EMBEDDING: config.embedding_init_method, Init.NORMAL: config.init_method, Init.SCALED_NORMAL: config.output_layer_init_method}


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize(
    "keys",
    [dict(), dict(embedding_init_method_std=1.0), dict(init_method_xavier_uniform=True),
     dict(init_method_xavier_uniform=True, embedding_init_method_std=0.02),  # the same std: the embeddings are xavier too
     dict(init_method_xavier_uniform=True, embedding_init_method_std=0.5, untie_embeddings_and_output_weights=True)],
)  # fmt: skip
def test_each_parameter_draws_as_megatrons_init_method_does(keys, swiglu):
    """Each weight of a GPT against the method megatron-core gives its role, applied to the tensor
    Megatron holds (SwiGLU's [gate; fc1] is one matrix there) from the same seed: the values agree
    exactly, so the distribution and the xavier fans do. The model then holds exactly its draws."""
    cfg = tiny(swiglu=swiglu, **keys)
    model, theirs = materialise(cfg, 64, seed=3), megatron_methods(cfg)
    for name, kind in model.init_kinds().items():
        if kind not in theirs:
            continue  # zeros and ones
        param = dict(model.named_parameters())[name]
        drawn, draw = model.initial_draw(name, kind, param.shape)
        megatron_shape = param.shape
        if swiglu and name.endswith((".mlp.fc1.weight", ".mlp.gate.weight")):
            megatron_shape = (2 * param.shape[0], param.shape[1])
        torch.manual_seed(11)
        expected = theirs[kind](torch.empty(megatron_shape))
        assert torch.equal(draw.sample(megatron_shape, torch.Generator().manual_seed(11), torch.device("cpu")), expected), name
        assert torch.equal(param, named_draw(drawn, param.shape, draw, 3, torch.device("cpu"))), name
    uniform = {n: model.initial_draw(n, k, p.shape)[1].uniform for (n, k), p in zip(model.init_kinds().items(), model.parameters())}
    assert uniform["layers.0.attention.qkv.weight"] == uniform["layers.0.attention.proj.weight"] == cfg.init_method_xavier_uniform
    assert uniform["embedding.word.weight"] == (cfg.init_method_xavier_uniform and cfg.embedding_init_method_std in (None, 0.02))


def test_xavier_bound_and_a_layers_statistics():
    """The formula (torch's gain 1), and a drawn matrix that spans it."""
    assert xavier_bound(48, 144) == pytest.approx((6 / 192) ** 0.5)
    model = materialise(tiny(init_method_xavier_uniform=True), 64, seed=3)
    w, bound = model.layers["0"].mlp.fc1.weight.detach(), xavier_bound(48, 192)
    assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound and float(w.std()) == pytest.approx(bound / 3**0.5, rel=0.05)


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(embedding_init_method_std=0.0), "model.embedding_init_method_std=0.0 must be > 0 (unset: model.init_method_std)"),
        (dict(init_method_xavier_uniform=True, num_experts=4), "model.init_method_xavier_uniform=true with model.num_experts=4: "
                                                               "xavier_uniform is built for dense models only"),
    ],
)  # fmt: skip
def test_init_keys_rules(keys, message):
    from dtgpt.config import Config, ConfigError, DataConfig, validate

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(Config(model=ModelConfig(**keys), data=DataConfig(mock_data=True)))


def test_a_shard_draws_its_region_of_the_full_xavier_weights():
    """init_weights with each rank's `local` region (here the second half of each parameter's
    rows, as a row split over tp would hold): the same values as the one full model, so the
    xavier fans are the full matrix's whatever the layout."""
    cfg = tiny(init_method_xavier_uniform=True, swiglu=True, embedding_init_method_std=0.5)
    full = materialise(cfg, 64, seed=3)
    shard = materialise(cfg, 64, seed=4)  # other values first, so that an unwritten region shows

    def second_half(param):
        rows = param.shape[0] // 2
        return param[rows:], (rows, *[0] * (param.dim() - 1))

    with torch.no_grad():
        shard.init_weights(3, local=second_half)
    for (name, a), b in zip(full.named_parameters(), shard.parameters()):
        rows = a.shape[0] // 2
        assert torch.equal(a[rows:], b[rows:]), name
