"""Tokenizers: a BPE vocabulary and a Hugging Face tokenizer directory trained in the test (no
downloads), byte and null tokenizers."""

import json
from pathlib import Path

import pytest

from dtgpt.config import DataConfig
from dtgpt.data.tokenizer import ByteTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, build_tokenizer

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
    from tests.megatron_oracle import megatron_null_tokenizer  # 1000 ids and the eod after them

    tok, theirs = NullTokenizer(1000), megatron_null_tokenizer(1000)
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


# -- HuggingFaceTokenizer ------------------------------------------------------------------------

HF_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|endoftext|>",
             "clean_up_tokenization_spaces": False}  # fmt: skip


def write_hf_tokenizer(directory: Path, config: dict | None = HF_CONFIG, special_tokens_map: dict | None = None) -> Path:
    """A Hugging Face tokenizer directory trained here: byte-level BPE whose post-processor adds a
    BOS, one added token outside the model's vocabulary, and a truncation to 8 tokens stored in
    tokenizer.json (transformers ignores it unless asked, so must dtgpt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(TEXTS, trainer)
    tok.add_special_tokens(["<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.enable_truncation(max_length=8)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special_tokens_map)):
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


HF_TEXTS = ["The quick brown fox jumps over the lazy dog, again and again and again.", "", " ", "héllo wörld ✓\n\tx",
            "a<|endoftext|>b", "<s> is text", "numbers 12345 " * 20]  # fmt: skip


def megatron_hf_tokenizer(directory: Path, include_special_tokens: bool = False):
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(tokenizer_path=str(directory), metadata_path={"library": "huggingface"},
                                             include_special_tokens=include_special_tokens)  # fmt: skip


@pytest.mark.parametrize("split", [False, True], ids=["", "split_special_tokens"])
@pytest.mark.parametrize("include", [False, True], ids=["megatron_default", "include_special_tokens"])
def test_hugging_face_tokenizer_is_megatrons(tmp_path, include, split):
    """megatron-core's HuggingFaceTokenizer (AutoTokenizer underneath) on the same directory gives
    the same vocabulary, eod and ids; transformers' PreTrainedTokenizerFast on the file too. With
    tokenizer_config.json's split_special_tokens, special-token text ("<|endoftext|>", "<pad>") is
    ordinary text there, and here."""
    import transformers

    directory = write_hf_tokenizer(tmp_path / "tok", {**HF_CONFIG, "split_special_tokens": split})
    ours = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory),
                                      tokenizer_hf_include_special_tokens=include))  # fmt: skip
    assert isinstance(ours, HuggingFaceTokenizer)
    theirs = megatron_hf_tokenizer(directory, include)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), eos_token="<|endoftext|>",
                                                split_special_tokens=split)  # fmt: skip
    assert ours.vocab_size == theirs.vocab_size == len(fast) == 321  # 320 in the BPE model, then the added <pad>
    assert ours.eod == theirs.eod == fast.eos_token_id == fast.convert_tokens_to_ids("<|endoftext|>")
    for text in HF_TEXTS:
        ids = ours.tokenize(text)
        assert ids == theirs.tokenize(text) == fast(text, add_special_tokens=include)["input_ids"], text
        assert ours.detokenize(ids) == fast.decode(ids), text
    assert len(ours.tokenize(HF_TEXTS[-1])) > 8  # the stored truncation does not cut documents
    assert (ours.tokenize("the")[0] == fast.convert_tokens_to_ids("<s>")) is include
    assert (ours.eod in ours.tokenize("a<|endoftext|>b")) is not split


@pytest.mark.parametrize("layout", ["config", "map only", "map overrides", "added tokens keep the config", "sep only"])
def test_hugging_face_eod_is_the_eos_transformers_reads(tmp_path, layout):
    """eos from tokenizer_config.json or special_tokens_map.json, as AutoTokenizer reads them (the map
    wins unless the config lists added_tokens_decoder); without an eos, Megatron's sep token."""
    eos, bos = {"__type": "AddedToken", "content": "<|endoftext|>"}, "<s>"  # the dict form transformers saved once
    config, special = {
        "config": ({"eos_token": eos}, None),
        "map only": (None, {"eos_token": "<|endoftext|>"}),
        "map overrides": ({"eos_token": bos}, {"eos_token": eos}),
        "added tokens keep the config": ({"eos_token": "<|endoftext|>", "added_tokens_decoder": {}}, {"eos_token": bos}),
        "sep only": ({"sep_token": "<|endoftext|>"}, None),
    }[layout]
    directory = write_hf_tokenizer(tmp_path / "tok", config, special)
    ours = HuggingFaceTokenizer(str(directory))
    assert ours.eod == megatron_hf_tokenizer(directory).eod == ours.tokenize("<|endoftext|>")[0]


def test_hugging_face_tokenizer_bad_input(tmp_path):
    """A missing key is a config error; a missing or unusable directory one line naming it."""
    from dtgpt.config import ConfigError, config_from_dict, load_config, validate

    with pytest.raises(ConfigError, match=r"data.tokenizer_type='HuggingFaceTokenizer' needs data.tokenizer_model"):
        load_config(None, ["--data.mock_data=true", "--data.tokenizer_type=HuggingFaceTokenizer"])
    good = write_hf_tokenizer(tmp_path / "good")
    both = config_from_dict({"data": {"builtin_corpus": "python-docstrings", "tokenizer_type": "HuggingFaceTokenizer",
                                      "tokenizer_model": str(good)}})  # fmt: skip
    with pytest.raises(ConfigError, match="data.builtin_corpus='python-docstrings' and data.tokenizer_model="):
        validate(both)
    (tmp_path / "empty").mkdir()
    unusable = [
        (tmp_path / "nope", FileNotFoundError, r"data.tokenizer_model='.*nope': no such directory"),
        (good / "tokenizer.json", ValueError, r"tokenizer.json' is a file: name the directory that holds tokenizer.json"),
        (tmp_path / "empty", FileNotFoundError, r"empty': holds no tokenizer.json"),
        (write_hf_tokenizer(tmp_path / "no_eos", None), ValueError,
         r"no_eos': no eos_token in tokenizer_config.json or special_tokens_map.json; HuggingFaceTokenizer ends documents"),
        (write_hf_tokenizer(tmp_path / "eos_unknown", {"eos_token": "</s>"}), ValueError,
         r"the eos_token '</s>' is not a token of its tokenizer.json"),
    ]  # fmt: skip
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    unusable.append((tmp_path / "broken", ValueError, r"cannot read .*broken/tokenizer.json: "))
    for directory, error, message in unusable:
        with pytest.raises(error, match=message) as caught:
            build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory)))
        assert "\n" not in str(caught.value)


def test_a_missing_tokenizers_library_is_a_user_error(monkeypatch):
    """train.py and the scripts print one line for it (dtgpt.cli.is_user_error), not a traceback."""
    import sys

    from dtgpt.cli import is_user_error
    from dtgpt.data.libraries import import_library

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ImportError, match=r"GPT2BPETokenizer needs the 'tokenizers' library: pip install 'dtgpt\[gpt2\]'") as e:
        import_library("GPT2BPETokenizer")
    assert is_user_error(e.value)
