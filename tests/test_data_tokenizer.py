"""Tokenizers: a BPE vocabulary trained in the test (no downloads), byte and null tokenizers."""

import json
import pickle

import pytest

from dtgpt.config import DataConfig
from dtgpt.data.tokenizer import ByteTokenizer, GPT2BPETokenizer, NullTokenizer, build_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the number of items in a container.",
    "def build_tokenizer(data_cfg): return the tokenizer the config asks for",
    "numbers 12345 and symbols {}[]() and the the the",
] * 20


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("bpe")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(TEXTS, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


def test_gpt2_bpe_round_trip(bpe_files):
    vocab_file, merge_file = bpe_files
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    vocab = json.load(open(vocab_file))
    assert tok.vocab_size == len(vocab)
    assert tok.eod == vocab["<|endoftext|>"]
    for text in ["The quick brown fox.", "unseen wörds ✓ and\nnewlines\t tabs", ""]:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # merges learnt from the training text are applied: fewer tokens than bytes
    text = "the quick brown fox jumps over the lazy dog"
    assert len(tok.tokenize(text)) < len(text.encode()) / 2
    assert tok.detokenize(tok.tokenize("a") + [tok.eod]) == "a<|endoftext|>"


def test_gpt2_bpe_pickles(bpe_files):
    tok = GPT2BPETokenizer(*bpe_files)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize("the lazy dog") == tok.tokenize("the lazy dog") and clone.eod == tok.eod


def test_gpt2_bpe_missing_files(tmp_path, bpe_files):
    vocab_file, merge_file = bpe_files
    missing = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match=r"data.vocab_file=.*nope\.json.*no such file"):
        GPT2BPETokenizer(missing, merge_file)
    with pytest.raises(FileNotFoundError, match=r"data.merge_file=.*nope\.json.*no such file"):
        GPT2BPETokenizer(vocab_file, missing)
    with pytest.raises(ValueError, match="needs data.vocab_file"):
        build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer"))


def test_gpt2_bpe_without_eod(tmp_path, bpe_files):
    vocab = json.load(open(bpe_files[0]))
    del vocab["<|endoftext|>"]
    (tmp_path / "v.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    with pytest.raises(ValueError, match=r"v\.json: has no <\|endoftext\|> token"):
        GPT2BPETokenizer(str(tmp_path / "v.json"), bpe_files[1])


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod) == (257, 256)
    text = "héllo wörld ✓\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod]) == text
    with pytest.raises(ValueError, match="outside"):
        tok.detokenize([257])


def test_null_tokenizer_is_megatrons():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as MegatronNull

    tok, theirs = NullTokenizer(1000), MegatronNull(1000)
    assert (tok.vocab_size, tok.eod) == (theirs.vocab_size, theirs.eod) == (1001, 1000)
    assert tok.tokenize("3 1 4") == theirs.text_to_ids("3 1 4")
    assert tok.tokenize("3 1 4 1 5\n9") == [3, 1, 4, 1, 5, 9]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match=r"outside \[0, 1000\)"):
        tok.tokenize("1 1000")
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("one two")


def test_build_tokenizer_choices(bpe_files):
    assert isinstance(build_tokenizer(DataConfig(tokenizer_type="ByteTokenizer")), ByteTokenizer)
    null = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=50))
    assert isinstance(null, NullTokenizer) and (null.vocab_size, null.eod) == (51, 50)
    # mock data reads no file: data.vocab_size is the whole vocabulary, eod its last id
    mock_null = build_tokenizer(DataConfig(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=50))
    assert (mock_null.vocab_size, mock_null.eod) == (50, 49)
    bpe = build_tokenizer(DataConfig(vocab_file=bpe_files[0], merge_file=bpe_files[1]))
    assert isinstance(bpe, GPT2BPETokenizer)
    # mock data with GPT-2 named but no files: GPT-2's vocabulary size and eod, no files needed
    mock = build_tokenizer(DataConfig(mock_data=True))
    assert (mock.vocab_size, mock.eod) == (50257, 50256)
    assert build_tokenizer(DataConfig(mock_data=True, vocab_size=1024)).vocab_size == 1024
    assert isinstance(build_tokenizer(DataConfig(builtin_corpus="python-docstrings")), ByteTokenizer)
    # another tokenizer named beside the built-in corpus is refused by validation (one rule, in
    # dtgpt/config/precedence.py), before any tokenizer is built
    from dtgpt.config import ConfigError, config_from_dict, validate

    both = config_from_dict({"data": {"builtin_corpus": "python-docstrings", "tokenizer_type": "NullTokenizer", "vocab_size": 9}})
    with pytest.raises(ConfigError, match="data.builtin_corpus='python-docstrings' and data.tokenizer_type='NullTokenizer'"):
        validate(both)
