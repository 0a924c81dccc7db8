"""`to-hf` / `from-hf` with a Llama-style model, checked with transformers' LlamaForCausalLM.

A dtgpt Llama-style model (RMSNorm, SwiGLU, 2 query groups for 4 heads, no biases, RoPE) must
export as a LlamaForCausalLM that transformers loads silently with dtgpt's logits, import back
to the same tensors, and train on from there; a directory transformers saved imports with its
logits; a GPT-3-style model still exports as GPT2LMHeadModel; a model neither holds is refused
in one line that names the keys.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
transformers = pytest.importorskip("transformers")  # in the dev extra; a bare venv skips these

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.architecture import architecture
from dtgpt.checkpoint.export import load_model, read_config, read_sections
from tests.runs import read_metrics, run_train
from tests.test_checkpoint_convert import load_script
from tests.checkpoints import checkpointer, make_trainer, step
from tests.test_hf_export import export, make_checkpoint, no_transformers_warnings

NO_FILES = Path("no-tokenizer-files")  # ByteTokenizer and NullTokenizer read none
LLAMA = ("--model.normalization=RMSNorm", "--model.swiglu=true", "--model.add_bias_linear=false", "--model.ffn_hidden_size=64",
         "--model.group_query_attention=true", "--model.num_query_groups=2", "--model.position_embedding_type=rope")  # fmt: skip
VARIANTS = {
    "untied": ((), False),
    "tied": ((), True),
    # Llama 3.1's scaling; transformers wants a context beyond the original 8192 tokens
    "rope_scaling": (("--model.use_rope_scaling=true", "--model.rope_scaling_factor=8", "--model.rotary_base=500000",
                      "--model.max_position_embeddings=65536"), False),  # fmt: skip
    "qkv_bias": (("--model.add_qkv_bias=true",), False),  # a zero o_proj bias on the way out
    "biases": (("--model.add_bias_linear=true",), True),
    "head_dim": (("--model.kv_channels=16",), False),  # heads x head_dim != hidden_size
    "layernorm_1p": (("--model.apply_layernorm_1p=true",), False),  # gamma - 1 stored: exported as gamma
    "interleaved": (("--model.rotary_interleaved=true",), True),  # q and k rows reordered to Llama's halves
}


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits if hasattr(model, "config") else model(ids)


def ids(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_export_loads_silently_with_dtgpt_logits_and_imports_back(tmp_path, variant):
    extra, tied = VARIANTS[variant]
    directory, out = export(tmp_path, "byte", NO_FILES, tied, (*LLAMA, *extra), command="to-hf")
    with no_transformers_warnings():
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        transformers.AutoTokenizer.from_pretrained(out)
    assert type(hf_model) is transformers.LlamaForCausalLM
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == (2, 384, tied)
    assert config.get("rope_scaling", {}).get("rope_type") == ("llama3" if variant == "rope_scaling" else None)
    cfg = read_config(directory)
    ours = load_model(directory, cfg).eval()
    torch.testing.assert_close(logits_of(hf_model, ids(384)), logits_of(ours, ids(384)), rtol=1e-5, atol=1e-5)

    base = tmp_path / "run.toml"  # the run's own config: its apply_layernorm_1p carries over
    base.write_text((directory / layout.CONFIG).read_text())
    assert load_script().main(["from-hf", str(out), str(tmp_path / "back"), "--config", str(base)]) == 0
    back = layout.iteration_dir(tmp_path / "back", 0)
    imported = read_config(back)
    assert architecture(imported.model) == architecture(cfg.model)
    stored, reread = read_sections(directory, ("model",))["model"], read_sections(back, ("model",))["model"]
    assert stored.keys() == reread.keys()
    for key in stored:  # exact, but for gamma - 1 + 1 - 1
        torch.testing.assert_close(reread[key], stored[key], rtol=0, atol=1e-7 if variant == "layernorm_1p" else 0)
    torch.testing.assert_close(logits_of(load_model(back, imported).eval(), ids(384)), logits_of(ours, ids(384)), rtol=1e-5, atol=1e-5)


def test_from_hf_without_a_config_takes_the_whole_architecture(tmp_path):
    """No --config: every architecture key comes from config.json (the defaults' LayerNorm,
    learned positions and GeLU are replaced), the tokenizer from the tokenizer files; the norms
    and RoPE pairs take the default conventions, with the same logits."""
    conventions = ("--model.apply_layernorm_1p=true", "--model.rotary_interleaved=true")
    directory, out = export(tmp_path, "byte", NO_FILES, False, (*LLAMA, *conventions), command="to-hf")
    assert load_script().main(["from-hf", str(out), str(tmp_path / "back")]) == 0
    back = layout.iteration_dir(tmp_path / "back", 0)
    original, imported = read_config(directory).model, read_config(back).model
    assert architecture(imported) == {**architecture(original), "apply_layernorm_1p": False, "rotary_interleaved": False}
    assert read_config(back).data.tokenizer_type == "ByteTokenizer"
    ours = load_model(directory, read_config(directory)).eval()
    torch.testing.assert_close(logits_of(load_model(back, read_config(back)).eval(), ids(384)), logits_of(ours, ids(384)), rtol=1e-5, atol=1e-5)


def imported_llama(tmp_path: Path) -> Path:
    """A dtgpt Llama-style checkpoint (NullTokenizer: the 128 rows make_trainer builds) through
    to-hf and from-hf; returns the imported checkpoint's root."""
    make_checkpoint(tmp_path / "ckpt", "null", NO_FILES, False, LLAMA)
    convert = load_script()
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    return tmp_path / "back"


def test_from_hf_output_trains_on(tmp_path):
    back = imported_llama(tmp_path)
    imported = read_sections(layout.iteration_dir(back, 0), ("model",))["model"]
    t = make_trainer(*LLAMA, "--model.untie_embeddings_and_output_weights=true", f"--checkpoint.load={back}",
                     "--checkpoint.load_optimizer=false")  # fmt: skip
    checkpointer(t)
    for name, p in t.state.model.parts[0].named_parameters():
        assert torch.equal(p, imported[name]), name
    step(t, 2)
    assert t.state.progress.iteration == 2
    assert any(not torch.equal(p, imported[name]) for name, p in t.state.model.parts[0].named_parameters())


@pytest.mark.slow
def test_train_py_resumes_from_hf_output(tmp_path):
    back = imported_llama(tmp_path)
    config = layout.iteration_dir(back, 0) / layout.CONFIG
    metrics = tmp_path / "metrics.jsonl"
    proc = run_train(tmp_path, [
        "--config", str(config), f"--checkpoint.load={back}", "--checkpoint.load_optimizer=false",
        "--training.train_iters=2", "--training.global_batch_size=2", "--model.seq_length=16", "--data.num_workers=0",
        "--eval.eval_iters=0", "--logging.log_interval=1", f"--logging.metrics_file={metrics}",
    ])  # fmt: skip
    assert f"loaded checkpoint {layout.iteration_dir(back, 0)}" in proc.stdout + proc.stderr
    losses = [r["loss"] for r in read_metrics(metrics)]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def save_like_hugging_face(out: Path, case: str) -> transformers.LlamaForCausalLM:
    """A Llama directory written by transformers itself (rope_parameters, transformers 5's keys)."""
    settings = {
        "gqa_llama3": dict(num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=65536,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "tied_attention_bias": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True),
        "mlp_bias": dict(num_key_value_heads=1, tie_word_embeddings=False, mlp_bias=True, head_dim=16),
    }[case]  # fmt: skip
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      vocab_size=100, rms_norm_eps=1e-5, **settings)  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # every tensor counts: norms and biases are constants at init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("case", ["gqa_llama3", "tied_attention_bias", "mlp_bias"])
def test_hugging_face_llama_directory_imports(tmp_path, case):
    hf_model = save_like_hugging_face(tmp_path / "llama", case)
    assert load_script().main(["from-hf", str(tmp_path / "llama"), str(tmp_path / "ckpt")]) == 0
    directory = layout.iteration_dir(tmp_path / "ckpt", 0)
    cfg = read_config(directory)
    assert (cfg.model.use_rope_scaling, cfg.model.rotary_base) == ((True, 500000) if case == "gqa_llama3" else (False, 10000))
    assert cfg.model.add_bias_linear is (case != "gqa_llama3")  # a non-zero o_proj bias needs add_bias_linear
    ours = load_model(directory, cfg).eval()
    torch.testing.assert_close(logits_of(ours, ids(100, 2))[..., :100], logits_of(hf_model, ids(100, 2)), rtol=1e-5, atol=1e-5)


def test_gpt3_style_models_still_export_as_gpt2(tmp_path):
    """to-hf picks GPT2LMHeadModel; a bias-free model with the exact GeLU is GPT-2 with zero
    biases and activation "gelu", and apply_layernorm_1p is folded into the weights."""
    model = ("--model.add_bias_linear=false", "--model.apply_layernorm_1p=true")
    directory, out = export(tmp_path, "byte", NO_FILES, True, model, command="to-hf")
    with no_transformers_warnings():
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model) is transformers.GPT2LMHeadModel
    assert json.loads((out / "config.json").read_text())["activation_function"] == "gelu"
    ours = load_model(directory, read_config(directory)).eval()
    torch.testing.assert_close(logits_of(hf_model, ids(384)), logits_of(ours, ids(384)), rtol=1e-5, atol=1e-5)


REFUSED = {
    "RMSNorm with learned positions": (("--model.normalization=RMSNorm",),
        "no Hugging Face model holds this one: GPT2LMHeadModel needs model.normalization='LayerNorm' (the config has 'RMSNorm'); "
        "LlamaForCausalLM needs model.position_embedding_type='rope' (the config has 'learned_absolute'), model.swiglu=true"),
    "GeLU MLP with RMSNorm": ((*LLAMA, "--model.swiglu=false"), "LlamaForCausalLM needs model.swiglu=true (the config has false);"),
    "qk_layernorm": ((*LLAMA, "--model.qk_layernorm=true"), "LlamaForCausalLM needs model.qk_layernorm=false (the config has true);"),
    "rotary_percent": ((*LLAMA, "--model.rotary_percent=0.5"), "model.rotary_percent=1.0 (the config has 0.5)"),
    "GPT-3 with query groups": (("--model.group_query_attention=true", "--model.num_query_groups=2"),
                                "GPT2LMHeadModel needs model.group_query_attention=false (the config has true);"),
}  # fmt: skip


def refused_line(capfd, argv: list[str]) -> str:
    capfd.readouterr()
    assert load_script().main(argv) == 2
    err = capfd.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("case", REFUSED)
def test_a_model_no_hugging_face_class_holds_is_one_line(tmp_path, capfd, case):
    model, expected = REFUSED[case]
    make_checkpoint(tmp_path / "ckpt", "byte", NO_FILES, True, model)
    err = refused_line(capfd, ["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert expected in err, err
    assert not (tmp_path / "hf").exists()


BAD_CONFIG = {
    "model_type": ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
                   "model_type='mistral' (architectures ['MistralForCausalLM']) is not GPT2LMHeadModel or LlamaForCausalLM"),
    "rope_type": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
                  "rope_type='yarn' is not one dtgpt has"),
    "llama3 bands": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 2.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
                     "rope_scaling low_freq_factor=2.0 is not 1.0"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act='gelu' is not 'silu'"),
    "untied without lm_head": ({"tie_word_embeddings": False, "_drop": "lm_head.weight"}, "the Llama weights have no tensor 'lm_head.weight'"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CONFIG)
def test_bad_llama_directory_is_one_line(tmp_path, capfd, case):
    from safetensors.torch import load_file, save_file

    save_like_hugging_face(tmp_path / "llama", "gqa_llama3")
    changes, expected = dict(BAD_CONFIG[case][0]), BAD_CONFIG[case][1]
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    drop = changes.pop("_drop", None)
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, **changes}))
    if drop:
        tensors = load_file(tmp_path / "llama" / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if k != drop}, tmp_path / "llama" / "model.safetensors")
    err = refused_line(capfd, ["from-hf", str(tmp_path / "llama"), str(tmp_path / "ckpt")])
    assert expected in err, err
