"""Bad input to the conversions and to what a fine-tune saves: each is one `error:` line before
anything is written, and nothing the command did not make is replaced.

Classes: data loss (an import into a run's root, a fine-tune saving over its source; to-hf into
a directory holding a model: tests/test_hf_export.py), tracebacks (corrupt or inconsistent
Hugging Face inputs), silent results (tensors that disagree with config.json, non-finite ones,
a model size of 0 or a RoPE base that trains nothing) and one-liners that say nothing (a missing
config.json key, an index without a weight_map, an MoE export, a Megatron directory given to a
dtgpt-only tool).
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.export import write_checkpoint
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.lock import check_save_dir
from dtgpt.config import ConfigError, load_config, padded_vocab_size
from dtgpt.data.tokenizer import build_tokenizer
from dtgpt.model import GPT
from tests.test_checkpoint_convert import load_script

pytestmark = pytest.mark.slow  # ~20 s of conversions: make test runs them

MODEL = ["--model.num_layers=1", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
         "--model.make_vocab_size_divisible_by=64", "--data.mock_data=true", "--data.tokenizer_type=ByteTokenizer"]  # fmt: skip


def checkpoint(root: Path, iteration: int = 3, extra: tuple[str, ...] = ()) -> Path:
    cfg = load_config(None, [*MODEL, *extra])
    vocab = padded_vocab_size(build_tokenizer(cfg.data).vocab_size, cfg.model.make_vocab_size_divisible_by)
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in GPT(cfg.model, vocab).state_dict().items()}
    return write_checkpoint(root, iteration, {"model": state}, cfg, source="test")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hf")
    checkpoint(tmp / "ckpt")
    assert load_script().main(["to-hf", str(tmp / "ckpt"), str(tmp / "hf")]) == 0
    return tmp / "hf"


def one_error(capfd) -> str:
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- data loss ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["from-hf", "from-torch"])
def test_an_import_into_a_run_root_is_refused_and_the_run_kept(tmp_path, hf_dir, capfd, command):
    run = tmp_path / "run"
    checkpoint(run, iteration=7)
    before = snapshot(run)
    src = hf_dir
    if command == "from-torch":
        assert load_script().main(["to-torch", str(run), str(tmp_path / "w.pt")]) == 0
        src = tmp_path / "w.pt"
    capfd.readouterr()
    assert load_script().main([command, str(src), str(run)]) == 2
    assert "already holds" in one_error(capfd)
    assert snapshot(run) == before


def test_a_finetune_never_saves_over_the_checkpoints_it_loads(tmp_path):
    run = tmp_path / "run"
    checkpoint(run, iteration=7)
    cfg = load_config(None, [*MODEL, f"--checkpoint.load={run}", f"--checkpoint.save={run}", "--checkpoint.finetune=true"])
    with pytest.raises(CheckpointError, match="checkpoint.finetune=true .* restarts at iteration 0: saving into the same"):
        check_save_dir(str(run), 0, cfg, loaded_from_it=True)
    cfg.checkpoint.finetune = False  # a plain resume continues its own run
    check_save_dir(str(run), 7, cfg, loaded_from_it=True)


# -- tracebacks and silent results: Hugging Face inputs ----------------------------------------


def _rewrite_header(path: Path, change) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def _config(change):
    def edit(d: Path):
        config = json.loads((d / "config.json").read_text())
        change(config)
        (d / "config.json").write_text(json.dumps(config))

    return edit


def _tensors(change):
    def edit(d: Path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(d / "model.safetensors"))

    return edit


def _first(tensors: dict, suffix: str) -> str:
    return next(k for k in tensors if k.endswith(suffix))


BROKEN = {  # name -> (how the directory is damaged, what the one line says)
    "truncated": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
                  "not a readable safetensors file"),
    "random-bytes": (lambda d: (d / "model.safetensors").write_bytes(bytes(range(256)) * 40), "not a readable safetensors file"),
    "absurd-header": (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}"),
                      "not a readable safetensors file"),
    "absurd-shape": (lambda d: _rewrite_header(d / "model.safetensors", lambda h: h[next(k for k in h if k != "__metadata__")]
                                               .update(shape=[1 << 40, 1 << 40])), "not a readable safetensors file"),
    "config-not-json": (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    "config-not-utf8": (lambda d: (d / "config.json").write_bytes(b"{\"n_embd\": \"\xff\xfe\"}"), "config.json: not UTF-8 text"),
    "config-a-list": (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json: holds a JSON list"),
    "config-wrong-type": (_config(lambda c: c.update(n_embd="32")), "config.json: n_embd='32' must be a whole number"),
    "config-missing-key": (_config(lambda c: c.pop("n_embd")), "config.json: no 'n_embd'"),
    "tokenizer-a-list": (lambda d: (d / "tokenizer.json").write_text("[]"), "tokenizer.json: holds a JSON list"),
    "index-without-weight-map": (lambda d: ((d / "model.safetensors").rename(d / "shard.safetensors"),
                                            (d / "model.safetensors.index.json").write_text('{"metadata": {}}')), "no weight_map"),
    "other-width": (_config(lambda c: c.update(n_embd=64)), "config.json and the weights disagree"),
    "int-tensor": (_tensors(lambda t: t.update({(k := _first(t, "ln_f.weight")): t[k].to(torch.int32)})),
                   "not floating-point weights"),
    "non-finite": (_tensors(lambda t: t[_first(t, "ln_f.weight")].__setitem__(0, float("nan"))), "non-finite values"),
}  # fmt: skip


@pytest.mark.parametrize("damage, message", BROKEN.values(), ids=BROKEN.keys())
def test_a_bad_hugging_face_directory_is_one_line_and_writes_nothing(tmp_path, hf_dir, capfd, damage, message):
    assert_import_refused(tmp_path, hf_dir, capfd, damage, message)


def assert_import_refused(tmp_path: Path, hf_dir: Path, capfd, damage, message: str) -> None:
    """from-hf of a copy of hf_dir that `damage` changed: one line holding `message`, nothing written."""
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    damage(src)
    capfd.readouterr()
    assert load_script().main(["from-hf", str(src), str(tmp_path / "out")]) == 2
    assert message in one_error(capfd)
    assert not (tmp_path / "out").exists()


# -- silent results: sizes that train nothing ---------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--model.swiglu=true", "--model.hidden_size=16"], "gives an MLP of width 0"),
        (["--model.position_embedding_type=rope", "--model.rotary_base=0"], "model.rotary_base=0 must be > 1"),
    ],
    ids=["swiglu-width-0", "rotary-base-0"],
)
def test_a_model_that_trains_nothing_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*MODEL, *overrides])


# -- one-liners that say what is wrong ----------------------------------------------------------


def test_an_moe_export_names_the_experts(tmp_path, capfd):
    checkpoint(tmp_path / "moe", extra=("--model.num_experts=2", "--model.moe_ffn_hidden_size=32"))
    assert load_script().main(["to-hf", str(tmp_path / "moe"), str(tmp_path / "hf")]) == 2
    assert "model.num_experts=None (the config has 2)" in one_error(capfd)
    assert not (tmp_path / "hf").exists()


SENTENCEPIECE_REFUSED = {
    "Unigram SentencePiece": ({"vocab_size": 330, "model_type": "unigram"}, "it is not a BPE model"),
    "whitespace as suffix": ({"treat_whitespace_as_suffix": True}, "it treats whitespace as a suffix"),
    "denormalizer": ({"denormalization_rule_tsv": "denormalize.tsv"}, "it has a denormalizer"),
    # SentencePiece cuts them out of the text before its dummy prefix and merges; tokenizers' added tokens,
    # matched before the normalizer, give other ids (e.g. "Hello, world!" with the piece "Hello")
    "user-defined pieces": ({"user_defined_symbols": ["<foo>", "Hello"]}, "it has user-defined pieces"),
}
"""SentencePiece models a Llama2Tokenizer export refuses: the trainer's options, the reason given."""


@pytest.mark.parametrize("case", ["TikTokenizer", *SENTENCEPIECE_REFUSED])
def test_an_export_of_a_run_whose_tokenizer_has_no_hugging_face_form_writes_nothing(tmp_path, capfd, case):
    """A TikTokenizer whose file spells a special token as an ordinary one, and a Llama2Tokenizer
    over a SentencePiece model whose encoding no tokenizer.json here reproduces (exported kinds:
    tests/test_hf_export.py): refused in one line before the weights are written, so no
    half-written export is left behind."""
    from tests.tokenizer_files import write_sentencepiece_model, write_tiktoken_vocab

    if case == "TikTokenizer":
        pytest.importorskip("tiktoken")
        vocab = write_tiktoken_vocab(tmp_path / "tt")
        entries = json.loads(vocab.read_text())
        entries[279]["token_bytes"] = base64.b64encode(b"<pad>").decode()  # the last token the run reads
        vocab.write_text(json.dumps(entries))
        data = ("--data.tokenizer_type=TikTokenizer", f"--data.tokenizer_model={vocab}",
                "--data.tiktoken_num_special_tokens=10", "--data.vocab_size=290")  # fmt: skip
        expected = "the TikTokenizer's special tokens ['<pad>'] are also ordinary tokens of the file"
    else:
        pytest.importorskip("sentencepiece")
        options, reason = SENTENCEPIECE_REFUSED[case]
        if "denormalization_rule_tsv" in options:
            rules = tmp_path / options["denormalization_rule_tsv"]
            rules.write_text("61\t41\n")  # a -> A, in code points
            options = {**options, "denormalization_rule_tsv": str(rules)}
        model = write_sentencepiece_model(tmp_path / "sp", **options)
        data = ("--data.tokenizer_type=Llama2Tokenizer", f"--data.tokenizer_model={model}")
        expected = (f"data.tokenizer_model={str(model)!r}: the Llama2Tokenizer's SentencePiece model has no Hugging Face "
                    f"form dtgpt writes: {reason}")  # fmt: skip
    checkpoint(tmp_path / "ckpt", extra=data)
    assert load_script().main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert expected in one_error(capfd)
    assert not (tmp_path / "hf").exists()


def test_a_megatron_directory_given_to_a_dtgpt_tool_is_named_so(tmp_path, capfd):
    checkpoint(tmp_path / "ckpt")
    assert load_script().main(["to-megatron", str(tmp_path / "ckpt"), str(tmp_path / "meg")]) == 0
    capfd.readouterr()
    for command in ("to-torch", "to-hf"):
        assert load_script().main([command, str(tmp_path / "meg"), str(tmp_path / "out")]) == 2
        err = one_error(capfd)
        assert "is a Megatron-LM checkpoint (iter_0000003), not a dtgpt one" in err and "complete" not in err


def test_no_conversion_replaces_an_existing_output(tmp_path, capfd):
    """to-torch onto a file, to-megatron (either format) onto a Megatron root or an iteration directory
    it would write: one line naming the path, and the bytes there unchanged."""
    checkpoint(tmp_path / "ckpt")
    kept = tmp_path / "kept.pt"
    kept.write_bytes(b"someone's file")
    assert load_script().main(["to-torch", str(tmp_path / "ckpt"), str(kept)]) == 2
    assert f"{kept} already exists: to-torch writes a new file" in one_error(capfd)
    assert kept.read_bytes() == b"someone's file"
    assert load_script().main(["to-megatron", str(tmp_path / "ckpt"), str(tmp_path / "meg")]) == 0
    capfd.readouterr()
    before = snapshot(tmp_path / "meg")
    for extra in ([], ["--format", "per-rank"]):
        assert load_script().main(["to-megatron", str(tmp_path / "ckpt"), str(tmp_path / "meg"), *extra]) == 2
        assert f"{tmp_path / 'meg'} already holds checkpoints (iterations 3..3)" in one_error(capfd)
        assert snapshot(tmp_path / "meg") == before
    partial = layout.iteration_dir(tmp_path / "other", 3)  # unsealed, no pointer: a Megatron save's, or a copy's
    partial.mkdir(parents=True)
    (partial / "common.pt").write_bytes(b"someone's file")
    for extra in ([], ["--format", "per-rank"]):
        assert load_script().main(["to-megatron", str(tmp_path / "ckpt"), str(tmp_path / "other"), *extra]) == 2
        assert f"{tmp_path / 'other'} already holds checkpoints (iterations 3..3)" in one_error(capfd)
        assert snapshot(tmp_path / "other") == {"iter_0000003/common.pt": b"someone's file"}


# -- DeepSeek-V3 directories that dtgpt's model cannot hold -------------------------------------


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    """A DeepSeek-V3 directory with a prediction module (the to-hf export of
    tests/test_hf_deepseek.py's model)."""
    from tests.test_hf_deepseek import DEEPSEEK
    from tests.test_hf_export import make_checkpoint
    from tests.test_hf_llama import NO_FILES

    tmp = tmp_path_factory.mktemp("deepseek")
    make_checkpoint(tmp / "ckpt", "null", NO_FILES, False, DEEPSEEK)
    assert load_script().main(["to-hf", str(tmp / "ckpt"), str(tmp / "hf")]) == 0
    return tmp / "hf"


def _rope_scaling(**change):
    return _config(lambda c: c["rope_scaling"].update(change))


DEEPSEEK_REFUSED = {  # name -> (how the directory differs, what the one line says)
    "rope-not-interleaved": (_config(lambda c: c.update(rope_interleave=False)), "rope_interleave=False is not true"),
    "group-score": (_config(lambda c: c.update(num_experts_per_tok=2)),
                    "num_experts_per_tok=2 is not 2 x topk_group=2: transformers scores a group by its top 2 experts"),
    "unnormalised-topk": (_config(lambda c: c.update(norm_topk_prob=False)),
                          "norm_topk_prob=False with num_experts_per_tok=4: dtgpt's sigmoid router normalises"),
    "rms-eps": (_config(lambda c: c.update(rms_norm_eps=1e-5)), "rms_norm_eps=1e-05 is not 1e-06"),
    "attention-bias": (_config(lambda c: c.update(attention_bias=True)), "attention_bias=True is not false"),
    "kv-heads": (_config(lambda c: c.update(num_key_value_heads=2)), "num_key_value_heads=2 is not num_attention_heads=4"),
    "all-dense": (_config(lambda c: c.update(first_k_dense_replace=4)), "first_k_dense_replace=4 leaves no MoE block"),
    "no-shared-expert": (_config(lambda c: c.update(n_shared_experts=0)), "n_shared_experts=0 is not >= 1"),
    "rope-type": (_rope_scaling(rope_type="linear"), "rope_type='linear' is not one dtgpt's multi-latent attention has"),
    "yarn-untruncated": (_rope_scaling(truncate=False), "rope_scaling truncate=False is not True"),
    "yarn-attention-factor": (_rope_scaling(attention_factor=2.0), "rope_scaling gives YaRN's cos/sin the factor 2.0"),
    "missing-expert": (_tensors(lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight")),
                       "the DeepseekV3 weights have no tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"),
    "scoring-func": (_config(lambda c: c.update(scoring_func="softmax")), "scoring_func='softmax' is not 'sigmoid'"),
    "topk-method": (_config(lambda c: c.update(topk_method="group_limited_greedy")), "topk_method='group_limited_greedy' is not"),
    "fp8": (_config(lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})),
            "quantization_config names quant_method='fp8': dtgpt reads unquantized weights"),
    "mtp-own-embedding": (_tensors(lambda t: t["model.layers.4.embed_tokens.weight"].mul_(2)),
                          "model.layers.4.embed_tokens.weight differs from the model's own"),
}  # fmt: skip


@pytest.mark.parametrize("change, message", DEEPSEEK_REFUSED.values(), ids=DEEPSEEK_REFUSED.keys())
def test_a_deepseek_directory_dtgpt_cannot_hold_is_one_line_and_writes_nothing(tmp_path, deepseek_dir, capfd, change, message):
    assert_import_refused(tmp_path, deepseek_dir, capfd, change, message)


@pytest.mark.parametrize(
    "extra, argv, message",
    [
        ((), ["--format", "per-rank", "--tp", "3"],  # wrote uneven files Megatron cannot load
         "error: --tp 3 must divide model.num_attention_heads=4: Megatron's tp ranks hold whole heads and key/value groups"),
        ((), ["--format", "per-rank", "--tp", "0"], "error: --tp 0 must be 1 or more"),  # a ZeroDivisionError
        ((), ["--tp", "-2"], "error: --tp -2 must be 1 or more"),  # "padded for tp -2"
        (("--model.ffn_hidden_size=102",), ["--format", "per-rank", "--tp", "4"],
         "error: --tp 4 does not split decoder.layers.0.mlp.linear_fc1.weight (102 along dim 0) evenly"),
    ],
    ids=["heads", "zero", "negative", "uneven-tensor"],
)
def test_a_megatron_export_at_a_tp_that_cannot_split_the_model_is_one_line_and_writes_nothing(tmp_path, capfd, extra, argv, message):
    checkpoint(tmp_path / "ckpt", extra=extra)
    assert load_script().main(["to-megatron", str(tmp_path / "ckpt"), str(tmp_path / "megatron"), *argv]) == 2
    assert message in one_error(capfd)
    assert not (tmp_path / "megatron").exists()
