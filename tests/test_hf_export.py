"""The Hugging Face GPT-2 round trip, checked with `transformers` itself (a pinned dev dependency).
(The Llama layout: tests/test_hf_llama.py.)

`to-hf` must write a directory that transformers loads whole and silently: the model gives
dtgpt's logits, AutoTokenizer gives dtgpt's token ids, and the text-generation pipeline
generates what dtgpt's own greedy sampler generates. `from-hf` must read such a directory,
and a directory transformers itself saved, back into a checkpoint that knows its tokenizer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import random
import warnings
from pathlib import Path

import pytest
import torch
transformers = pytest.importorskip("transformers")  # in the dev extra; a bare venv skips these
from safetensors.torch import load_file, save_file

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.export import load_model, read_config, read_sections, write_checkpoint
from dtgpt.config import load_config
from dtgpt.data.tokenizer import build_tokenizer
from dtgpt.config import padded_vocab_size
from dtgpt.model import GPT
from tests.runs import REPO
from tests.test_checkpoint_convert import load_script
from tests.test_data_tokenizer import write_hf_tokenizer
from tests.tokenizer_files import write_sentencepiece_model, write_tiktoken_vocab

MODEL = ["--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=32"]
BPE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the number of items in a container.",
    "numbers 12345 and symbols {}[]() and the the the",
    "héllo wörld ✓ naïve café",
] * 20


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A GPT-2 style vocab.json + merges.txt trained here (no downloads), and in HF_TOKENIZER a
    Hugging Face tokenizer directory (tests/test_data_tokenizer.py)."""
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("bpe")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(BPE_TEXTS, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(d))
    write_hf_tokenizer(d / HF_TOKENIZER)
    return d


HF_TOKENIZER = "hf_tokenizer"
# Megatron's SentencePiece types: a model trained with SentencePiece's defaults (NFKC, extra spaces
# removed) and one trained as Llama's was (no normalization, every space kept)
SENTENCEPIECE = {"sp": {}, "sp-llama": {"normalization_rule_name": "identity", "remove_extra_whitespaces": False}}


def tokenizer_args(kind: str, bpe_dir: Path) -> list[str]:
    if kind == "byte":
        return ["--data.tokenizer_type=ByteTokenizer"]
    if kind == "null":
        return ["--data.tokenizer_type=NullTokenizer", "--data.vocab_size=100"]
    if kind == "hf":
        return ["--data.tokenizer_type=HuggingFaceTokenizer", f"--data.tokenizer_model={bpe_dir / HF_TOKENIZER}"]
    if kind in SENTENCEPIECE:
        pytest.importorskip("sentencepiece")
        model = bpe_dir / kind / "tokenizer.model"
        if not model.is_file():
            write_sentencepiece_model(model.parent, **SENTENCEPIECE[kind])
        return ["--data.tokenizer_type=Llama2Tokenizer", f"--data.tokenizer_model={model}"]
    if kind == "tiktoken":  # Megatron's pattern v1, its seven special tokens and three fillers
        pytest.importorskip("tiktoken")
        vocab = bpe_dir / kind / "tokenizer.json"
        if not vocab.is_file():
            write_tiktoken_vocab(vocab.parent)
        return ["--data.tokenizer_type=TikTokenizer", f"--data.tokenizer_model={vocab}", "--data.tiktoken_pattern=v1",
                "--data.tiktoken_num_special_tokens=10", "--data.vocab_size=290"]  # fmt: skip
    return ["--data.tokenizer_type=GPT2BPETokenizer", f"--data.vocab_file={bpe_dir / 'vocab.json'}",
            f"--data.merge_file={bpe_dir / 'merges.txt'}"]  # fmt: skip


def make_checkpoint(root: Path, kind: str, bpe_dir: Path, tied: bool = True, model: tuple[str, ...] = ()) -> Path:
    """A one-process checkpoint of a small GPT (MODEL, then `model`'s overrides) whose every
    parameter (biases and norms too) is random."""
    args = [*MODEL, *model, "--data.mock_data=true", f"--model.untie_embeddings_and_output_weights={str(not tied).lower()}"]
    cfg = load_config(None, args + tokenizer_args(kind, bpe_dir))
    vocab = padded_vocab_size(build_tokenizer(cfg.data).vocab_size, cfg.model.make_vocab_size_divisible_by)
    model = GPT(cfg.model, vocab)
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in model.state_dict().items()}
    write_checkpoint(root, 5, {"model": state}, cfg, source="test")
    return layout.iteration_dir(root, 5)


def export(tmp_path: Path, kind: str, bpe_dir: Path, tied: bool = True, model: tuple[str, ...] = (), command: str = "to-hf") -> tuple[Path, Path]:
    """(checkpoint iteration directory, exported directory). Some tests below say to-gpt2 and
    from-gpt2, the earlier names of to-hf and from-hf, so that those keep working."""
    directory = make_checkpoint(tmp_path / "ckpt", kind, bpe_dir, tied, model)
    assert load_script().main([command, str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    return directory, tmp_path / "hf"


class _Collect(logging.Handler):
    def __init__(self, records: list):
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def no_transformers_warnings():
    """Fail if transformers logs a warning (its logger does not propagate) or anything warns."""
    records: list[logging.LogRecord] = []
    handler = _Collect(records)
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [r.getMessage() for r in records] == []
    assert [str(w.message) for w in caught] == []


def sample_texts(kind: str) -> list[str]:
    """A few hundred strings: fixed ones with unicode and odd whitespace, then seeded random ones."""
    rng = random.Random(0)
    if kind == "null":
        # mock data's NullTokenizer of vocab_size 100: ids 0..98, eod 99
        fixed = ["", "0", "98", "1 2 3", "  7\t8\n9  ", "42 42 42 0 98"]
        return fixed + [" ".join(str(rng.randrange(99)) for _ in range(rng.randrange(1, 30))) for _ in range(300)]
    fixed = ["", " ", "Hello, world!", " leading space", "trailing  ", "tabs\tand\nnewlines\r\n",
             "héllo wörld ✓ naïve café", "日本語のテキスト", "emoji 🙂🚀 and ZWJ 👩‍💻", "Ελληνικά и кириллица",
             "<|endoftext|> is text here", "a<|endoftext|>b", "don't   stop'll 've", "x" * 200,
             "</s> is text here", "a</s>b<s>", "<unk> <pad>", "\n", "   ", "a    b\n\n\nc", "say HelloWorld's 123"]  # fmt: skip
    pool = "abcdefghij ABC   0123456789.,;:!?'\"()[]{}\n\t-_/é∑ßüñ中文字🙂👍<|>"
    return fixed + ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 60))) for _ in range(300)]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_loads_silently_with_dtgpt_logits(tmp_path, bpe_dir, tied):
    directory, out = export(tmp_path, "byte", bpe_dir, tied)
    with no_transformers_warnings():
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(hf_model, transformers.GPT2LMHeadModel)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (256, 256, 384)
    assert config["tie_word_embeddings"] is tied
    ours = load_model(directory, read_config(directory)).eval()
    ids = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    if not tied:  # the head is its own tensor, not the embedding
        assert not torch.equal(hf_model.lm_head.weight, hf_model.transformer.wte.weight)


@pytest.mark.parametrize("kind", ["byte", "null", "bpe", "hf", "sp", "sp-llama", "tiktoken"])
def test_autotokenizer_gives_dtgpt_ids(tmp_path, bpe_dir, kind):
    directory, out = export(tmp_path, kind, bpe_dir)
    ours = build_tokenizer(read_config(directory).data)
    with no_transformers_warnings():
        theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token_id == ours.eod
    texts = sample_texts(kind)
    assert len(texts) >= 300
    # HuggingFaceTokenizer leaves out the BOS its files' post-processor adds, as Megatron's does
    special = kind != "hf"
    for text in texts:
        ids = ours.tokenize(text)
        assert theirs(text, add_special_tokens=special)["input_ids"] == ids, text
        assert theirs.decode(ids) == ours.detokenize(ids), text
        if kind in SENTENCEPIECE:  # bos, pad and eos are special: a decode that skips them drops them, as SentencePiece's
            with_controls = [ours.bos, *ids, ours.pad, ours.eod]
            assert theirs.decode(with_controls, skip_special_tokens=True) == ours.detokenize(with_controls), text
    # the run's own files travel with the export, as they are
    names = {"bpe": ("vocab.json", "merges.txt"), "hf": ("tokenizer.json", "tokenizer_config.json")}.get(kind, ())
    source = bpe_dir / HF_TOKENIZER if kind == "hf" else bpe_dir
    for name in names:
        assert (out / name).read_bytes() == (source / name).read_bytes()


def test_hugging_face_tokenizer_without_config_exports_its_eos(tmp_path):
    """Files that name the eos in special_tokens_map.json alone travel with a minimal
    tokenizer_config.json, so transformers reads them as the fast tokenizer with that eos."""
    files = tmp_path / "files"
    write_hf_tokenizer(files / HF_TOKENIZER, config=None, special_tokens_map={"eos_token": "<|endoftext|>"})
    directory, out = export(tmp_path, "hf", files)
    ours = build_tokenizer(read_config(directory).data)
    assert sorted(p.name for p in out.glob("*token*")) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    with no_transformers_warnings():
        theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token_id == ours.eod and len(theirs) == ours.vocab_size
    assert theirs(BPE_TEXTS[3], add_special_tokens=False)["input_ids"] == ours.tokenize(BPE_TEXTS[3])


def dtgpt_greedy(directory: Path, prompt_ids: list[int], n: int) -> list[int]:
    spec = importlib.util.spec_from_file_location("generate", REPO / "scripts/generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    cfg = read_config(directory)
    vocab = build_tokenizer(cfg.data).vocab_size
    model = load_model(directory, cfg).eval()
    return generate.sample(model, prompt_ids, n, 0.0, 0, vocab, torch.Generator())[len(prompt_ids):]


@pytest.mark.parametrize("kind,prompt", [("byte", "Hello"), ("null", "1 2 3"), ("bpe", "The quick")])
def test_pipeline_generates_dtgpt_greedy_text(tmp_path, bpe_dir, kind, prompt):
    directory, out = export(tmp_path, kind, bpe_dir)
    with no_transformers_warnings():
        generator = transformers.pipeline("text-generation", model=str(out))
    text = generator(prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    ours = build_tokenizer(read_config(directory).data)
    continuation = dtgpt_greedy(directory, ours.tokenize(prompt), 12)
    if ours.eod in continuation:  # transformers stops at the eos, the eod
        continuation = continuation[: continuation.index(ours.eod)]
    assert continuation, "the greedy continuation is empty: the test would not show generation"
    # the pipeline appends the decoded new tokens to the prompt as they are (with NullTokenizer, no space)
    assert text == prompt + ours.detokenize(continuation)


def test_docs_snippet_generates(tmp_path, bpe_dir, capsys):
    """The three lines of docs/checkpoints.md, run on an export."""
    _, out = export(tmp_path, "byte", bpe_dir)
    docs = (REPO / "docs/checkpoints.md").read_text()
    snippet = docs.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(snippet.strip().splitlines()) == 3 and '"hf_dir"' in snippet
    capsys.readouterr()
    torch.manual_seed(0)
    exec(snippet.replace('"hf_dir"', repr(str(out))), {})
    assert capsys.readouterr().out.startswith("Return the")


def test_files_take_the_process_umask(tmp_path, bpe_dir):
    old = os.umask(0o027)
    try:
        _, out = export(tmp_path, "bpe", bpe_dir)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o640)}, modes


@pytest.mark.parametrize("kind,tied", [("byte", False), ("null", True), ("bpe", True), ("hf", True), ("sp", True), ("tiktoken", True)])
def test_export_imports_back_with_its_tokenizer(tmp_path, bpe_dir, kind, tied):
    directory, out = export(tmp_path, kind, bpe_dir, tied)
    convert = load_script()
    assert convert.main(["from-hf", str(out), str(tmp_path / "back")]) == 0
    back = layout.iteration_dir(tmp_path / "back", 0)
    original, imported = read_config(directory), read_config(back)
    texts = sample_texts(kind)
    if kind == "tiktoken":  # its tokenizer.json comes back as a HuggingFaceTokenizer, with the same ids
        assert imported.data.tokenizer_type == "HuggingFaceTokenizer"
    elif kind in SENTENCEPIECE:  # the export holds no .model: its tokenizer.json comes back as a HuggingFaceTokenizer,
        # whose ids are the model's, text spelling a control piece ("</s>") included: its tokenizer_config.json's
        # split_special_tokens reads it as text, as SentencePiece does
        assert imported.data.tokenizer_type == "HuggingFaceTokenizer"
        assert any("</s>" in t for t in texts)
    else:
        assert imported.data.tokenizer_type == original.data.tokenizer_type
    assert imported.model.untie_embeddings_and_output_weights is not tied
    if kind == "null":  # the same ids and eod (the export's config says vocab_size 99 ids, not mock data)
        assert (build_tokenizer(imported.data).eod, build_tokenizer(imported.data).vocab_size) == (99, 100)
    if kind == "bpe":  # copied into the checkpoint, so the export directory may go
        assert Path(imported.data.vocab_file).parent == back.resolve()
        assert Path(imported.data.vocab_file).read_bytes() == (bpe_dir / "vocab.json").read_bytes()
    if kind == "hf":  # the same: the directory holds the run's tokenizer files
        assert Path(imported.data.tokenizer_model) == back.resolve()
        assert (back / "tokenizer.json").read_bytes() == (bpe_dir / HF_TOKENIZER / "tokenizer.json").read_bytes()
    theirs, ours = build_tokenizer(imported.data), build_tokenizer(original.data)
    assert [theirs.tokenize(t) for t in texts] == [ours.tokenize(t) for t in texts]
    stored, reread = read_sections(directory, ("model",))["model"], read_sections(back, ("model",))["model"]
    assert stored.keys() == reread.keys()
    for key in stored:
        assert torch.equal(stored[key], reread[key]), key


def test_export_into_a_directory_holding_a_model_is_refused(tmp_path, bpe_dir, capfd):
    """to-hf replaces nothing it did not make: a directory holding another model's files (an
    earlier export here) is refused in one line and left as it was; a new directory takes it."""
    export(tmp_path / "first", "bpe", bpe_dir)
    make_checkpoint(tmp_path / "byte", "byte", bpe_dir)
    out = tmp_path / "first" / "hf"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capfd.readouterr()
    assert load_script().main(["to-gpt2", str(tmp_path / "byte"), str(out)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: {out} is not empty (it holds config.json") and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    out = tmp_path / "second"
    assert load_script().main(["to-gpt2", str(tmp_path / "byte"), str(out)]) == 0
    assert not (out / "vocab.json").exists() and not (out / "merges.txt").exists()
    assert load_script().main(["from-gpt2", str(out), str(tmp_path / "back")]) == 0
    assert read_config(layout.iteration_dir(tmp_path / "back", 0)).data.tokenizer_type == "ByteTokenizer"


def save_like_hugging_face(out: Path, bpe_dir: Path, layout_name: str) -> transformers.GPT2LMHeadModel:
    """A GPT-2 directory written by transformers itself, in one of the layouts found in the wild."""
    vocab = len(json.loads((bpe_dir / "vocab.json").read_text()))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=vocab,
                                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF initialises biases and norms to constants; make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, max_shard_size="20KB" if layout_name == "sharded" else "5GB")
    if layout_name == "hub":  # openai-community/gpt2: no "transformer." prefix, the causal masks stored
        tensors = {k.removeprefix("transformer."): v for k, v in load_file(out / "model.safetensors").items()}
        tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32).tril() for i in range(2)})
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("vocab.json", "merges.txt"):
        (out / name).write_bytes((bpe_dir / name).read_bytes())
    return model


@pytest.mark.parametrize("layout_name", ["save_pretrained", "hub", "sharded"])
def test_hugging_face_gpt2_directory_imports(tmp_path, bpe_dir, layout_name):
    hf_model = save_like_hugging_face(tmp_path / "gpt2", bpe_dir, layout_name)
    assert (tmp_path / "gpt2" / "model.safetensors.index.json").is_file() == (layout_name == "sharded")
    assert load_script().main(["from-hf", str(tmp_path / "gpt2"), str(tmp_path / "ckpt")]) == 0
    directory = layout.iteration_dir(tmp_path / "ckpt", 0)
    cfg = read_config(directory)
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"
    assert build_tokenizer(cfg.data).tokenize(BPE_TEXTS[3]) == build_tokenizer(
        load_config(None, ["--data.mock_data=true", *tokenizer_args("bpe", bpe_dir)]).data).tokenize(BPE_TEXTS[3])
    ours = load_model(directory, cfg).eval()
    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[..., :vocab], hf_model(ids).logits, rtol=1e-5, atol=1e-5)


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("case", ["activation", "untied without lm_head", "tokenizer too big", "tokenizer without eos"])
def test_bad_input_is_one_clear_line(tmp_path, bpe_dir, capfd, case):
    if case == "tokenizer too big":  # a --config whose tokenizer does not fit the checkpoint's 128 rows
        make_checkpoint(tmp_path / "ckpt", "null", bpe_dir)
        (tmp_path / "big.toml").write_text("[data]\nmock_data = true\ntokenizer_type = 'NullTokenizer'\nvocab_size = 1000\n")
        argv, expected = ["to-gpt2", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config", str(tmp_path / "big.toml")], \
            "the tokenizer has 1000 tokens but the model's vocabulary only 128 rows"  # fmt: skip
    else:
        save_like_hugging_face(tmp_path / "gpt2", bpe_dir, "save_pretrained")
        if case == "activation":
            edit_config(tmp_path / "gpt2", activation_function="relu")
            expected = "gpt2/config.json: activation_function='relu' is not one of"
        elif case == "untied without lm_head":
            edit_config(tmp_path / "gpt2", tie_word_embeddings=False)
            expected = "the GPT-2 weights have no tensor 'lm_head.weight'"
        else:  # a tokenizer.json dtgpt reads as HuggingFaceTokenizer, but nothing names its eos
            for name in ("vocab.json", "merges.txt"):
                (tmp_path / "gpt2" / name).unlink()
            write_hf_tokenizer(tmp_path / "gpt2", config=None)
            expected = "gpt2': no eos_token in tokenizer_config.json or special_tokens_map.json"
        argv = ["from-gpt2", str(tmp_path / "gpt2"), str(tmp_path / "ckpt")]
    capfd.readouterr()  # transformers' progress bars
    assert load_script().main(argv) == 2
    err = capfd.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and expected in err, err
