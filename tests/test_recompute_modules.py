"""Selective recomputation of Megatron's recompute_modules: the same gradients, what each keeps, the rules.

Gradients: every module recomputed (alone, and Megatron's DeepSeek-V3 list together) gives the
loss and the gradients of the run without recomputation, with dropout on, for the dense GPT, an
MoE model and multi-latent attention (one process, tiny). The rules: each refusal is one line
naming the key, the value and the rule, and dtgpt refuses what megatron-core's TransformerConfig
refuses (the oracle), plus a list set without 'selective'.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import dtgpt
from dtgpt.config import Config, ConfigError, load_config
from dtgpt.config.recompute_rules import MODULES, UNBUILT, selective_modules
from dtgpt.model import GPT
from dtgpt.parallel import ParallelDims, build_model_parts
from dtgpt.parallel.recompute import block_recompute
from dtgpt.parallel.recompute_modules import recomputed_modules
from dtgpt.step import local_forward_backward

VOCAB = 64
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
DENSE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, **DROPOUT)
MOE = dict(DENSE, swiglu=True, add_bias_linear=False, num_experts=4, moe_router_topk=2, moe_grouped_gemm=True,
           moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=32, moe_ffn_hidden_size=32,
           moe_layer_freq="[0,1]")  # fmt: skip
MLA = dict(DENSE, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
           v_head_dim=8, qk_layernorm=True, position_embedding_type="rope", rope_type="rope")  # fmt: skip
DEEPSEEK_V3 = ["mlp", "moe", "mla_up_proj", "layernorm"]  # Megatron's DeepSeek-V3 launch script
MODELS = {"dense": DENSE, "moe": MOE, "mla": MLA, "mla+moe": {**MLA, **{k: v for k, v in MOE.items() if k not in DENSE}}}
CASES = [
    ("dense", ["core_attn"]), ("dense", ["mlp"]), ("dense", ["layernorm"]), ("dense", ["core_attn", "mlp", "layernorm"]),
    ("moe", ["moe"]), ("moe", ["shared_experts"]), ("moe", ["moe_act"]), ("moe", ["mlp", "moe_act", "shared_experts", "layernorm"]),
    ("mla", ["mla_up_proj"]), ("mla", ["core_attn", "mla_up_proj"]), ("mla", ["layernorm"]),
    ("mla+moe", DEEPSEEK_V3),
]  # fmt: skip


def _config(model: str, modules: list[str] | None) -> Config:
    training = dict(micro_batch_size=2, global_batch_size=4, train_iters=1)
    if modules is not None:
        training.update(recompute_granularity="selective", recompute_modules=modules)
    return dtgpt.make_config(
        model=MODELS[model], training=training, data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB)
    )


def _run(model: str, modules: list[str] | None):
    cfg = _config(model, modules)
    with torch.device("meta"):
        whole = GPT(cfg.model, VOCAB)
    parts = build_model_parts(cfg, ParallelDims.from_config(cfg, 1), whole, torch.device("cpu"))
    batch = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(123)  # the dropout masks
    loss = local_forward_backward(parts, batch, 2)
    blocks = parts.forward_module().layers.values()
    return loss, {n: p.grad.clone() for n, p in parts.forward_module().named_parameters()}, [recomputed_modules(b) for b in blocks]


@pytest.mark.parametrize("model,modules", CASES, ids=[f"{m}-{'+'.join(ms)}" for m, ms in CASES])
def test_recomputed_modules_give_the_same_gradients_with_dropout(model, modules):
    loss, grads, _ = _run(model, None)
    loss_r, grads_r, recomputed = _run(model, modules)
    assert any(recomputed), "nothing was set up for recomputation"
    assert set().union(*recomputed) <= set(modules)
    assert loss_r.item() == loss.item()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_each_block_recomputes_what_applies_to_it():
    """DeepSeek-V3's list on a dense block and an MoE block (Megatron: 'mlp' only where the MLP is dense)."""
    _, _, recomputed = _run("mla+moe", DEEPSEEK_V3)
    assert recomputed == [("mlp", "layernorm", "mla_up_proj"), ("moe", "layernorm", "mla_up_proj")]
    cfg = _config("moe", ["moe_act", "shared_experts"])
    with torch.device("meta"):
        whole = GPT(cfg.model, VOCAB)
    parts = build_model_parts(cfg, ParallelDims.from_config(cfg, 1), whole, torch.device("cpu"))
    assert block_recompute(parts.forward_module()) == {"0": "none", "1": "selective"}  # block 0 is dense


def test_layernorm_releases_the_norm_outputs_until_backward():
    """The output-discarding kind frees its storage after the sub-layer, and backward still works."""
    from dtgpt.discard import discard_until_backward

    x = torch.randn(4, 8, requires_grad=True)
    norm = torch.nn.LayerNorm(8)
    normed = norm(x)
    out = normed @ torch.ones(8, 3, requires_grad=True)  # keeps `normed` for its weight's gradient
    discard_until_backward([normed], lambda: [norm(x)], out)
    assert normed.untyped_storage().nbytes() == 0
    out.sum().backward()
    reference = torch.nn.functional.layer_norm(x.detach(), (8,), norm.weight.detach(), norm.bias.detach())
    torch.testing.assert_close(normed.detach(), reference)


# -- the rules -------------------------------------------------------------------------------------


def _load(*args: str) -> Config:
    return load_config(None, ["--data.mock_data=true", *args])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--training.recompute_granularity=selective", "--training.recompute_modules=['attn']"],
         "training.recompute_modules=['attn']: 'attn' is not one of core_attn, mlp, moe"),
        (["--training.recompute_granularity=selective", "--training.recompute_modules=['mhc']"],
         "'mhc' recomputes hyper-connections, which dtgpt's model does not have"),
        (["--training.recompute_modules=['mlp']"],
         "training.recompute_modules=['mlp'] applies only to training.recompute_granularity='selective' (it is None)"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
          "--recompute-modules", "mlp"], "applies only to training.recompute_granularity='selective' (it is 'full')"),
        (["--recompute-activations", "--recompute-modules", "mla_up_proj"],
         "training.recompute_modules=['mla_up_proj']: 'mla_up_proj' needs model.multi_latent_attention=true"),
        (["--recompute-activations", "--recompute-modules", "moe_act", "--num-experts", "4"],
         "training.recompute_modules=['moe_act']: 'moe_act' needs model.moe_grouped_gemm=true"),
        (["--moe-layer-recompute", "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
         "training.moe_layer_recompute=true cannot go with training.recompute_granularity='full'"),
    ],
)  # fmt: skip
def test_bad_recompute_modules_name_the_key_value_and_rule(args, message):
    with pytest.raises(ConfigError) as err:
        _load(*args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_megatrons_flags_set_the_keys():
    mla = ["--multi-latent-attention", "--position-embedding-type", "rope", "--q-lora-rank", "16", "--kv-lora-rank", "16"]
    t = _load(*mla, "--recompute-granularity", "selective", "--recompute-modules", *DEEPSEEK_V3).training
    assert (t.recompute_granularity, t.recompute_modules) == ("selective", DEEPSEEK_V3)
    t = _load("--recompute-activations").training  # Megatron: --recompute-granularity selective
    assert (t.recompute_granularity, selective_modules(t)) == ("selective", ("core_attn",))
    t = _load("--recompute-activations", "--moe-layer-recompute").training  # Megatron appends 'moe'
    assert (t.recompute_granularity, selective_modules(t)) == ("selective", ("core_attn", "moe"))
    t = _load("--moe-layer-recompute", "--recompute-modules", "mlp", "moe").training
    assert selective_modules(t) == ("mlp", "moe")
    assert selective_modules(_load().training) == ()


# -- Megatron's own rules, from megatron-core -----------------------------------------------------

ORACLE = [
    # (recompute_modules, moe_grouped_gemm, multi_latent_attention)
    (["core_attn"], False, False), (DEEPSEEK_V3, False, True), (DEEPSEEK_V3, False, False),
    (["moe_act"], True, False), (["moe_act"], False, False), (["shared_experts", "moe"], False, False),
    (["layernorm", "mlp"], False, False), (["attention"], False, False), ([], False, False),
]  # fmt: skip


def _megatron_refuses(modules: list[str], grouped_gemm: bool, mla: bool) -> bool:
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kind = MLATransformerConfig if mla else TransformerConfig
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kind(num_layers=2, hidden_size=32, num_attention_heads=4, recompute_granularity="selective",
                 recompute_modules=list(modules), moe_grouped_gemm=grouped_gemm, num_moe_experts=4 if grouped_gemm else None)  # fmt: skip
    except (AssertionError, ValueError):
        return True
    return False


@pytest.mark.parametrize("modules,grouped_gemm,mla", ORACLE)
def test_dtgpt_refuses_what_megatron_core_refuses(modules, grouped_gemm, mla):
    model = dict(num_experts=4, moe_router_topk=2, moe_grouped_gemm=True) if grouped_gemm else {}
    if mla:
        model.update(MLA)
    try:
        dtgpt.make_config(model=model, training=dict(recompute_granularity="selective", recompute_modules=modules),
                          data=dict(mock_data=True))  # fmt: skip
        refused = False
    except ConfigError:
        refused = True
    assert refused == _megatron_refuses(modules, grouped_gemm, mla)


def test_every_name_megatron_core_knows_is_built_or_named():
    """The names megatron-core 0.16.1 accepts are the ones dtgpt builds; newer ones are refused by name."""
    pytest.importorskip("megatron.core")
    import inspect

    from megatron.core.transformer import transformer_config

    source = inspect.getsource(transformer_config.TransformerConfig.__post_init__)
    known = {name for name in (*MODULES, *UNBUILT, "attention") if f'"{name}"' in source}
    assert set(MODULES) <= known and "attention" not in known
