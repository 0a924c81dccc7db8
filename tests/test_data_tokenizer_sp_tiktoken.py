"""Megatron's SentencePiece tokenizers and TikTokenizer against megatron-core's own classes
(megatron.core.tokenizers, built as Megatron's build_tokenizer builds them) on a SentencePiece model
and a tiktoken vocabulary trained in the test: the same vocabulary, eod, bos, pad and ids, in
training and in preprocessing; bad input is one line."""

from __future__ import annotations

import json
import pickle
import sys
from argparse import Namespace

import pytest

from dtgpt.cli import is_user_error, run_main
from dtgpt.config import ConfigError, DataConfig, load_config
from dtgpt.config.tokenizer_rules import SENTENCEPIECE_TYPES
from dtgpt.data.indexed import IndexedDataset
from dtgpt.data.libraries import import_library
from dtgpt.data.tokenizer import build_tokenizer
from tests.runs import load_script
from tests.test_data_tokenizer import HF_TEXTS, bpe_files, write_hf_tokenizer  # noqa: F401 (bpe_files: a fixture)
from tests.tokenizer_files import write_sentencepiece_model, write_tiktoken_vocab

TEXTS = ["", "The quick brown fox jumps over the lazy dog.", "héllo wörld ✓ 日本語 🙂 ünseen",
         "<s> special </s> tokens <pad> as text <unk><mask>", "  two  spaces,\n\tnewlines\n\n", "0123456789 " * 5, "HelloWorld"]  # fmt: skip

TIKTOKEN_CASES = {
    "defaults": {"tiktoken_num_special_tokens": 10},  # Megatron's seven special tokens (and 3 fillers), pattern v2
    "v1 and own specials": {"tiktoken_pattern": "v1", "tokenizer_special_tokens": ["<pad>", "<|im_start|>", "<unk>", "<s>",
                            "</s>", "<mask>", "<cls>", "<sep>"], "tiktoken_num_special_tokens": 12},  # fmt: skip
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizers")
    return {"sp": write_sentencepiece_model(d / "sp"), "tiktoken": write_tiktoken_vocab(d / "tiktoken")}


def megatrons(**data) -> object:
    """megatron-core's tokenizer for these `[data]` keys, through its own build_tokenizer (0.16's
    module, or the newer one that `make test-oracle` has: the arguments of both are given)."""
    try:
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as megatron_build_tokenizer
    except ImportError:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build_tokenizer

    special = data.get("tokenizer_special_tokens")
    args = Namespace(tokenizer_type=data["tokenizer_type"], tokenizer_model=data["tokenizer_model"], tokenizer_metadata=None,
                     metadata_path=None, tokenizer_sentencepiece_legacy=False, tokenizer_special_tokens=special,
                     special_tokens=special, tiktoken_pattern=data.get("tiktoken_pattern"), vocab_size=data.get("vocab_size"),
                     tiktoken_num_special_tokens=data.get("tiktoken_num_special_tokens", 1000), chat_template=None,
                     tokenizer_sentencepiece_ignore_extra_whitespaces=True, pad_vocab_size=False)  # fmt: skip
    return megatron_build_tokenizer(args)


def assert_same_as_megatron(ours, theirs) -> None:
    assert (ours.vocab_size, ours.eod, ours.bos, ours.pad) == (theirs.vocab_size, theirs.eod, theirs.bos, theirs.pad)
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == theirs.tokenize(text), text
        assert all(0 <= i < ours.vocab_size for i in ids)


@pytest.mark.parametrize("kind", SENTENCEPIECE_TYPES)
def test_sentencepiece_types_are_megatrons(files, kind):
    data = {"tokenizer_type": kind, "tokenizer_model": str(files["sp"])}
    ours = build_tokenizer(DataConfig(**data))
    assert_same_as_megatron(ours, megatrons(**data))
    assert (ours.vocab_size, ours.eod, ours.bos, ours.pad) == (400, 2, 1, 3)  # the trained model's
    assert ours.detokenize(ours.tokenize(TEXTS[1])) == TEXTS[1]


@pytest.mark.parametrize("case", TIKTOKEN_CASES)
def test_tiktokenizer_is_megatrons(files, case):
    data = {"tokenizer_type": "TikTokenizer", "tokenizer_model": str(files["tiktoken"]), "vocab_size": 290, **TIKTOKEN_CASES[case]}
    ours = build_tokenizer(DataConfig(**data))
    assert_same_as_megatron(ours, megatrons(**data))
    specials = data.get("tokenizer_special_tokens") or ["<unk>", "<s>", "</s>"]
    assert ours.eod == specials.index("</s>") and ours.tokenize("a</s>b")[1] == ours.eod  # special text is its id
    assert min(ours.tokenize(TEXTS[1])) >= data.get("tiktoken_num_special_tokens", 1000)  # the file's ids follow them
    assert ours.detokenize(ours.tokenize(TEXTS[2])) == TEXTS[2]
    other = build_tokenizer(DataConfig(**{**data, "tiktoken_pattern": "v2" if data.get("tiktoken_pattern") == "v1" else "v1"}))
    assert ours.tokenize(" HelloWorld") != other.tokenize(" HelloWorld")  # one word in v1, two in v2: the pattern is read


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer"])
def test_file_tokenizers_pickle_as_their_arguments(tmp_path, files, bpe_files, kind):
    """Each tokenizer read from files pickles as its constructor's arguments (its library object does
    not pickle) and is rebuilt where it is unpickled: the same ids, eod and vocabulary, non-default
    arguments kept (a BOS added, Llama2Tokenizer's kind, TikTokenizer's pattern and special tokens)."""
    data = {
        "GPT2BPETokenizer": lambda: {"vocab_file": bpe_files[0], "merge_file": bpe_files[1]},
        "HuggingFaceTokenizer": lambda: {"tokenizer_model": str(write_hf_tokenizer(tmp_path)),
                                         "tokenizer_hf_include_special_tokens": True},
        "Llama2Tokenizer": lambda: {"tokenizer_model": str(files["sp"])},
        "TikTokenizer": lambda: {"tokenizer_model": str(files["tiktoken"]), "tiktoken_pattern": "v1", "vocab_size": 290,
                                 "tiktoken_num_special_tokens": 8, "tokenizer_special_tokens":
                                 ["<s>", "</s>", "<unk>", "<mask>", "<pad>", "<cls>", "<sep>", "<extra>"]},
    }[kind]()  # fmt: skip
    tok = build_tokenizer(DataConfig(tokenizer_type=kind, **data))
    pickled = pickle.dumps(tok)
    assert len(pickled) < 1000  # the arguments, not the vocabulary (the library objects pickle as 5-250 kB here)
    clone = pickle.loads(pickled)
    assert type(clone) is type(tok) and (clone.vocab_size, clone.eod) == (tok.vocab_size, tok.eod)
    for text in [*TEXTS, *HF_TEXTS, "<s> </s> <extra> as text"]:
        assert clone.tokenize(text) == tok.tokenize(text), text
    assert vars(clone).keys() == vars(tok).keys() and clone._arguments == tok._arguments


def test_megatron_flags_set_the_tokenizer_keys(files):
    cfg = load_config(None, ["--mock-data", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(files["tiktoken"]),
                             "--tiktoken-pattern", "v1", "--tiktoken-num-special-tokens", "12", "--vocab-size", "290",
                             "--tiktoken-special-tokens", *TIKTOKEN_CASES["v1 and own specials"]["tokenizer_special_tokens"]])  # fmt: skip
    d = cfg.data
    assert (d.tokenizer_type, d.tokenizer_model, d.tiktoken_pattern, d.tiktoken_num_special_tokens, d.vocab_size) == (
        "TikTokenizer", str(files["tiktoken"]), "v1", 12, 290)
    assert d.tokenizer_special_tokens == TIKTOKEN_CASES["v1 and own specials"]["tokenizer_special_tokens"]
    assert load_config(None, ["--mock-data", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(files["sp"])]
                       ).data.tokenizer_type == "Llama2Tokenizer"  # fmt: skip


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "TikTokenizer"])
def test_preprocessing_writes_megatrons_ids(files, tmp_path, capfd, kind):
    """scripts/preprocess_data.py with Megatron's flags (two worker processes) writes Megatron's ids and its eod."""
    model = files["sp" if kind != "TikTokenizer" else "tiktoken"]
    extra = ["--vocab-size", "290", "--tiktoken-num-special-tokens", "10"] if kind == "TikTokenizer" else []
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[1:]))
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", kind,
            "--tokenizer-model", str(model), "--append-eod", "--workers", "2", *extra]  # fmt: skip
    assert load_script("preprocess_data").main(argv) == 0, capfd.readouterr().err
    theirs = megatrons(tokenizer_type=kind, tokenizer_model=str(model), **({"vocab_size": 290, "tiktoken_num_special_tokens": 10} if extra else {}))
    written = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [written[i].tolist() for i in range(len(written))] == [theirs.tokenize(t) + [theirs.eod] for t in TEXTS[1:]]


def one_error_line(argv: list[str], capfd) -> str:
    code = run_main(argv, None, None)
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_bad_tokenizer_input_is_one_line(files, tmp_path, capfd):
    base = ["--mock-data", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1"]  # fmt: skip
    sp, tik = ["--tokenizer-type", "Llama2Tokenizer"], ["--tokenizer-type", "TikTokenizer", "--vocab-size", "290"]
    tik10 = tik + ["--tiktoken-num-special-tokens", "10"]
    eosless = write_sentencepiece_model(tmp_path / "eosless", eos_id=-1)
    cases = [
        (sp, "error: --tokenizer-type Llama2Tokenizer needs --tokenizer-model, its SentencePiece .model file"),
        (sp + ["--tokenizer-model", str(tmp_path / "none.model")], "no such file (Llama2Tokenizer reads a SentencePiece .model"),
        (sp + ["--tokenizer-model", str(tmp_path)], "a directory, not a file"),
        (sp + ["--tokenizer-model", str(files["tiktoken"])], "is not a SentencePiece model (Llama2Tokenizer)"),
        (sp + ["--tokenizer-model", str(eosless)], "the SentencePiece model has no eos piece"),
        (sp + ["--tokenizer-model", str(files["sp"]), "--tokenizer-special-tokens", "<x>"], "is refused for Llama2Tokenizer: dtgpt reads special tokens for TikTokenizer only"),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--tokenizer-special-tokens", "<x>"], "is refused for NullTokenizer"),
        (tik10 + ["--tokenizer-model", str(files["sp"])], "TikTokenizer reads a vocabulary .json"),
        (tik10 + ["--tokenizer-model", str(files["tiktoken"]), "--tiktoken-pattern", "v3"], "error: --tiktoken-pattern v3 is not one of Megatron's patterns"),
        (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(files["tiktoken"])],
         "holds 300 tokens: TikTokenizer's vocabulary of 131072 with 1000 special tokens needs 130072; set --vocab-size to at most 1300"),
        (tik + ["--tokenizer-model", str(files["tiktoken"]), "--tiktoken-num-special-tokens", "5"],
         "error: --tiktoken-num-special-tokens 5 must be at least the 7 special tokens"),
        (tik10 + ["--tokenizer-model", str(files["tiktoken"]), "--tokenizer-special-tokens", "<unk>", "<s>"],
         "lacks ['</s>', '<mask>', '<pad>', '<cls>', '<sep>']"),
    ]
    wrong = [(args, err) for args, message in cases if message not in (err := one_error_line(base + args, capfd))]
    assert not wrong, wrong


@pytest.mark.parametrize("kind, library, extra", [("Llama2Tokenizer", "sentencepiece", "sentencepiece"),
                                                  ("TikTokenizer", "tiktoken", "tiktoken")])  # fmt: skip
def test_a_missing_library_names_the_pip_extra_before_any_process_group(monkeypatch, capfd, files, kind, library, extra):
    monkeypatch.setitem(sys.modules, library, None)  # as if not installed: no spec, and importing it raises ImportError
    line = f"{kind} needs the '{library}' library: pip install 'dtgpt[{extra}]'"
    with pytest.raises(ConfigError, match=rf"data.tokenizer_type='{kind}': " + line.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, ["--mock-data", "--tokenizer-type", kind, "--tokenizer-model", str(files["sp"])])
    with pytest.raises(ImportError) as caught:
        import_library(kind)
    assert str(caught.value) == line and is_user_error(caught.value)


def test_preprocessing_refuses_what_would_give_other_ids(files, tmp_path, capfd):
    """Megatron's legacy classes beside the types whose ids they change, special tokens beside a type that
    does not read them, and a missing model file: one error line each, nothing written."""
    corpus = tmp_path / "in.jsonl"
    corpus.write_text(json.dumps({"text": "one document"}) + "\n")
    base = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out")]
    cases = [
        (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(files["sp"]), "--legacy-tokenizer"],
         "error: --legacy-tokenizer is refused beside --tokenizer-type Llama2Tokenizer"),
        (["--tokenizer-type", "ByteTokenizer", "--tokenizer-special-tokens", "<x>"], "is refused for ByteTokenizer"),
        (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tmp_path / "none.json")], "no such file"),
    ]  # fmt: skip
    for args, message in cases:
        assert load_script("preprocess_data").main(base + args) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("out*"))
    assert load_script("preprocess_data").main(base + ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                                                       str(files["sp"]), "--legacy-tokenizer"]) == 0  # the same ids there
