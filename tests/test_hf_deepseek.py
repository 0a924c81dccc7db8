"""`to-hf` / `from-hf` with a DeepSeek-V3-style model, checked with transformers' DeepseekV3ForCausalLM.

The model of tests/test_parity_deepseek.py's flags (multi-latent attention with a compressed
query, its norms and YaRN; one dense block, then MoE blocks of 8 experts and a shared one;
sigmoid routing with a non-zero expert bias, group-limited to 2 of 4 groups, weights scaled by
2.5; one prediction module), every tensor random, must export as a DeepseekV3ForCausalLM with
dtgpt's logits (fp32), the prediction module stored as DeepSeek publishes it, and import back
to the same tensors bitwise; a directory transformers saved itself imports with its logits
and trains on; what the class cannot hold is refused in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
transformers = pytest.importorskip("transformers")  # in the dev extra; a bare venv skips these
from safetensors.torch import load_file

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.architecture import FIELDS, architecture
from dtgpt.checkpoint.export import hf_layout_for, load_model, read_config, read_sections
from dtgpt.checkpoint.hf_checks import replace_model
from dtgpt.checkpoint.hf_deepseek_config import YARN_KEYS, deepseek_config, deepseek_overrides
from dtgpt.config import ModelConfig, load_config
from dtgpt.mtp import shift_left
from tests.test_checkpoint_convert import load_script
from tests.runs import REPO
from tests.checkpoints import checkpointer, make_trainer, step
from tests.test_hf_export import MODEL, make_checkpoint
from tests.test_hf_llama import NO_FILES, ids, logits_of, refused_line
from tests.test_parity_deepseek import DEEPSEEK_MTP

# DeepSeek-V3's own eps (transformers' q_a_layernorm and kv_a_layernorm have no other) and
# context, YaRN's 40 x 4096 (transformers warns at another)
DEEPSEEK = (*DEEPSEEK_MTP, "--model.num_layers=4", "--model.hidden_size=64", "--norm-epsilon", "1e-6",
            "--model.max_position_embeddings=163840")  # fmt: skip


def loaded_quietly_but_for_the_prediction_module(out: Path, layers: int | None) -> transformers.PreTrainedModel:
    """transformers' model, whose only complaint is the prediction module's tensors (layer
    `layers`), which its model leaves out (it silences them for DeepSeek-V3's layer 61 only)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    if layers is None:  # no prediction module: not a word
        assert messages == [], messages
        return model
    assert len(messages) == 1 and "LOAD REPORT" in messages[0], messages
    keys = [line.split("|")[0].strip() for line in messages[0].splitlines() if "| UNEXPECTED" in line]
    assert keys and all(key.startswith(f"model.layers.{layers}.") for key in keys), messages[0]
    assert "MISSING" not in messages[0] and "MISMATCH" not in messages[0], messages[0]
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """(the DeepSeek-style checkpoint's iteration directory, its to-hf directory)."""
    tmp = tmp_path_factory.mktemp("deepseek")
    directory = make_checkpoint(tmp / "ckpt", "null", NO_FILES, False, DEEPSEEK)
    assert load_script().main(["to-hf", str(tmp / "ckpt"), str(tmp / "hf")]) == 0
    return directory, tmp / "hf"


def assert_same_logits_and_bitwise_back(directory: Path, out: Path, tmp_path: Path, prediction_layer: int | None) -> None:
    """transformers' model from `out` gives the checkpoint's logits (fp32), and from-hf (with the
    run's config) gives back its architecture and every tensor bitwise."""
    hf_model = loaded_quietly_but_for_the_prediction_module(out, prediction_layer)
    assert type(hf_model) is transformers.DeepseekV3ForCausalLM
    cfg = read_config(directory)
    stored = read_sections(directory, ("model",))["model"]
    ours = load_model(directory, cfg).eval()
    torch.testing.assert_close(logits_of(hf_model, ids(128)), logits_of(ours, ids(128)), rtol=1e-5, atol=1e-5)
    base = tmp_path / "run.toml"
    base.write_text((directory / layout.CONFIG).read_text())
    assert load_script().main(["from-hf", str(out), str(tmp_path / "back"), "--config", str(base)]) == 0
    back = layout.iteration_dir(tmp_path / "back", 0)
    assert architecture(read_config(back).model) == architecture(cfg.model)
    reread = read_sections(back, ("model",))["model"]
    assert stored.keys() == reread.keys()
    for key in stored:
        assert torch.equal(reread[key], stored[key]), key


def test_deepseek_export_gives_dtgpt_logits_and_imports_back_bitwise(tmp_path, exported):
    directory, out = exported
    config = json.loads((out / "config.json").read_text())
    assert (config["first_k_dense_replace"], config["n_group"], config["topk_group"], config["num_nextn_predict_layers"]) == (1, 4, 2, 1)
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_interleave"] is True
    stored = read_sections(directory, ("model",))["model"]
    assert stored["layers.1.mlp.router.expert_bias"].abs().min() > 0  # the bias moves the choice
    assert "mtp.layers.0.eh_proj.weight" in stored
    assert_same_logits_and_bitwise_back(directory, out, tmp_path, 4)


VARIANTS = {
    # the query projected in one, a tied head, top-1 without groups (no norm_topk_prob), no
    # prediction module, YaRN's cos/sin factor not what transformers infers (attention_factor)
    "q_proj_tied_top1": (dict(q_lora_rank=None, untie_embeddings_and_output_weights=None, moe_router_topk="1",
                              moe_router_num_groups=None, moe_router_group_topk=None, mtp_num_layers=None, mscale="0.5",
                              mscale_all_dim="0"), "attention_factor"),
    "plain_rope": (dict(rope_type="rope", rotary_scaling_factor="1", mscale_all_dim="0", mtp_num_layers=None), None),
}  # fmt: skip


@pytest.mark.slow  # ~10 s; the fast set has the full model above
@pytest.mark.parametrize("variant", VARIANTS)
def test_deepseek_variants_give_dtgpt_logits_and_import_back_bitwise(tmp_path, variant):
    values, scaling_key = VARIANTS[variant]
    tied = "untie_embeddings_and_output_weights" in values
    directory = make_checkpoint(tmp_path / "ckpt", "null", NO_FILES, tied, changed(DEEPSEEK, **values))
    assert load_script().main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and ("rope_scaling" in config) is (variant != "plain_rope")
    if scaling_key:
        assert scaling_key in config["rope_scaling"]
    assert_same_logits_and_bitwise_back(directory, tmp_path / "hf", tmp_path, None)


def test_the_prediction_module_is_stored_as_transformers_runs_it(exported):
    """transformers' own prediction layer (MtpLayer: enorm, hnorm, eh_proj over [embedding,
    hidden], a decoder layer, post_norm), given layer 4's tensors, gives the logits of dtgpt's
    module for the same hidden state, shifted tokens and positions."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    directory, out = exported
    hf_model = loaded_quietly_but_for_the_prediction_module(out, 4)
    layer = MtpLayer(hf_model.config, deepseek.DeepseekV3DecoderLayer, deepseek.DeepseekV3RMSNorm, 4).eval()  # 4: an MoE block
    tensors = {k.removeprefix("model.layers.4."): v for k, v in load_file(out / "model.safetensors").items() if k.startswith("model.layers.4.")}
    experts = [f"mlp.experts.{e}." for e in range(8)]
    fused = {"mlp.experts.gate_up_proj": torch.stack([torch.cat([tensors[e + "gate_proj.weight"], tensors[e + "up_proj.weight"]]) for e in experts]),
             "mlp.experts.down_proj": torch.stack([tensors[e + "down_proj.weight"] for e in experts])}  # fmt: skip
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight"}
    state = {k if k in own else f"mtp_block.{k}": v for k, v in {**tensors, **fused}.items() if ".experts." not in k or k in fused}
    state["post_norm.weight"] = state.pop("mtp_block.shared_head.norm.weight")
    for copy in ("mtp_block.embed_tokens.weight", "mtp_block.shared_head.head.weight"):
        state.pop(copy)
    layer.load_state_dict(state, strict=True)

    ours = load_model(directory, read_config(directory)).eval()
    tokens = ids(128)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        hidden = ours.embedding(tokens)
        for block in ours.layers.values():
            hidden = block(hidden)
        hidden = ours.norm(hidden)
        (expected,) = ours.mtp(hidden, tokens, ours.embedding, ours.output)
        shifted = shift_left(tokens, 0)
        theirs = layer(hf_model.model.embed_tokens(shifted), hidden, hf_model.model.rotary_emb(hidden, positions),
                       attention_mask=None, position_ids=positions, past_key_values=None)  # fmt: skip
        torch.testing.assert_close(hf_model.lm_head(theirs), expected, rtol=1e-5, atol=1e-5)


PUBLISHED = {  # DeepSeek-V3's config.json as deepseek-ai publishes it, but its fp8 quantization_config
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "rope_theta": 10000, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip


def test_deepseek_v3s_published_config_is_configs_deepseek_v3():
    """DeepSeek-V3's published config.json (its prediction module's weights present) reads as
    configs/deepseek_v3.toml's architecture, and that config writes DeepSeek's config.json but
    for the init std (the Megatron recipe's) and how it spells the same YaRN."""
    recipe = load_config(str(REPO / "configs" / "deepseek_v3.toml")).model
    read = deepseek_overrides(PUBLISHED, {"model.layers.61.eh_proj.weight": torch.zeros(1)}, "config.json")
    assert architecture(replace_model(ModelConfig(), read, "config.json")) == architecture(recipe)
    written = deepseek_config(recipe, PUBLISHED["vocab_size"], 1)
    differ = {key for key, value in PUBLISHED.items() if written.get(key) != value}
    assert differ == {"ep_size", "initializer_range", "rope_scaling"}, differ
    published = PUBLISHED["rope_scaling"]
    assert written["rope_scaling"] == {**{k: v for k, v in published.items() if k != "type"}, "rope_type": published["type"]}


def save_like_hugging_face(out: Path) -> transformers.DeepseekV3ForCausalLM:
    """A DeepSeek-V3 directory written by transformers itself: its own init, every tensor then
    moved (norms and the expert bias are constants at init), YaRN as DeepSeek-V3 sets it."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=4,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1},
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.state_dict().values():  # the saved tensors (the rotary buffers are not)
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return model


def architecture_overrides(m: ModelConfig) -> list[str]:
    """The imported architecture as overrides (YaRN's keys too), for a trainer of another base."""
    keys = (*FIELDS, *YARN_KEYS)
    return [f"--model.{key}={str(getattr(m, key)).lower() if isinstance(getattr(m, key), bool) else getattr(m, key)}"
            for key in keys if getattr(m, key) is not None]  # fmt: skip


def test_hugging_face_deepseek_directory_imports_and_trains(tmp_path):
    hf_model = save_like_hugging_face(tmp_path / "ds")
    assert load_script().main(["from-hf", str(tmp_path / "ds"), str(tmp_path / "ckpt")]) == 0
    directory = layout.iteration_dir(tmp_path / "ckpt", 0)
    cfg = read_config(directory)
    m = cfg.model
    assert (m.moe_layer_freq, m.moe_router_group_topk, m.moe_shared_expert_intermediate_size, m.mtp_num_layers) == ("([0]*1+[1]*2)", 2, 32, None)
    ours = load_model(directory, cfg).eval()
    torch.testing.assert_close(logits_of(ours, ids(100, 2))[..., :100], logits_of(hf_model, ids(100, 2)), rtol=1e-5, atol=1e-5)

    t = make_trainer(*architecture_overrides(m), f"--checkpoint.load={tmp_path / 'ckpt'}", "--checkpoint.load_optimizer=false")
    checkpointer(t)
    imported = read_sections(directory, ("model",))["model"]
    for name, p in t.state.model.parts[0].named_parameters():
        assert torch.equal(p, imported[name]), name
    step(t, 1)
    assert any(not torch.equal(p, imported[name]) for name, p in t.state.model.parts[0].named_parameters())


def changed(flags: tuple[str, ...], **values: str | None) -> tuple[str, ...]:
    """DEEPSEEK with Megatron flags given other values (None: the flag left out)."""
    out, args = [], list(flags)
    while args:
        arg = args.pop(0)
        name = arg[2:].replace("-", "_")
        takes_value = bool(args) and not args[0].startswith("--")
        value = args.pop(0) if takes_value else None
        if name not in values:
            out += [arg] + ([value] if takes_value else [])
        elif values[name] is not None:
            out += [arg] + ([values[name]] if takes_value else [])
    return tuple(out)


REFUSED = {
    "softmax routing": (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=None, moe_router_bias_update_rate=None),
                        "DeepseekV3ForCausalLM needs model.moe_router_score_function='sigmoid' (the config has 'softmax')"),
    "MoE first": (dict(moe_layer_freq="([1]*1+[0]*1+[1]*2)"), "model.moe_layer_freq='dense blocks first, then MoE blocks"),
    "group score": (dict(moe_router_topk="2"), "needs model.moe_router_topk=4 (the config has 2) with model.moe_router_group_topk=2"),
    "norm eps": (dict(norm_epsilon="1e-5"), "model.norm_epsilon=1e-06 (the config has 1e-05)"),
    "no latent norms": (dict(qk_layernorm=None), "DeepseekV3ForCausalLM needs model.qk_layernorm=true (the config has false)"),
    "shared width": (dict(moe_shared_expert_intermediate_size="48"),
                     "model.moe_shared_expert_intermediate_size='a multiple of the expert width 32' (the config has 48)"),
    "softmax scale without YaRN": (dict(rope_type="rope"), "model.mscale_all_dim=0.0 (the config has 1.0) without YaRN"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_a_deepseek_model_the_class_cannot_hold_is_refused_by_name(case):
    values, expected = REFUSED[case]
    cfg = load_config(None, [*MODEL, *changed(DEEPSEEK, **values), "--data.mock_data=true", "--model.untie_embeddings_and_output_weights=true"])
    with pytest.raises(ValueError) as err:
        hf_layout_for(cfg.model)
    assert expected in str(err.value) and "\n" not in str(err.value), err.value


def test_to_hf_of_such_a_model_is_one_line_and_writes_nothing(tmp_path, capfd):
    make_checkpoint(tmp_path / "ckpt", "null", NO_FILES, False, changed(DEEPSEEK, **REFUSED["softmax routing"][0]))
    err = refused_line(capfd, ["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert REFUSED["softmax routing"][1] in err, err
    assert not (tmp_path / "hf").exists()
