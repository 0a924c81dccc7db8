"""dtgpt's tokenizers as Hugging Face tokenizer files, and back.

An export carries the run's tokenizer so that `AutoTokenizer.from_pretrained(dir)` gives the ids
dtgpt gave in training:

- GPT2BPETokenizer: its `vocab.json` and `merges.txt` (copied as the run used them), read by
  transformers' `GPT2Tokenizer`.
- ByteTokenizer: a byte-level BPE with no merges, so each UTF-8 byte is one token whose id is
  the byte's value; `<|endoftext|>` is id 256, the eod.
- NullTokenizer: a word-level vocabulary "0" ... "n-1" split on whitespace.
- HuggingFaceTokenizer: its own tokenizer.json and tokenizer_config.json (and
  special_tokens_map.json), copied as the run read them.
- Megatron's SentencePiece types (SentencePieceTokenizer, GPTSentencePieceTokenizer,
  Llama2Tokenizer): a tokenizer.json built from the BPE model's pieces (hf_sentencepiece.py), no
  bos added, eos the model's eos piece, the eod.
- TikTokenizer: a byte-level BPE tokenizer.json built from its ranks, special tokens and
  pattern (hf_tiktoken.py); special-token text is the token, as TikTokenizer encodes it.

A model those two cannot carry exactly (a Unigram SentencePiece model, say) is refused before
anything is written (exportable_backend, which builds what is written then).

dtgpt's own kinds are also written as a `tokenizers` JSON (`tokenizer.json`). The eod is the
special end-of-text token, but text is never searched for it (`split_special_tokens`): dtgpt's
tokenizers read the literal text "<|endoftext|>" (or "</s>") as ordinary characters, as
Megatron's do; only TikTokenizer reads special-token text as the token, and so does its export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dtgpt.checkpoint import hf_sentencepiece, hf_tiktoken
from dtgpt.checkpoint.byte_alphabet import byte_alphabet
from dtgpt.checkpoint.hf_checks import read_json_object
from dtgpt.data.sentencepiece_tokenizer import SentencePieceTokenizer
from dtgpt.data.tiktoken_tokenizer import TikTokenizer
from dtgpt.data.tokenizer import (
    EOD_TEXT,
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    ByteTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    Tokenizer,
)

HF_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
VOCAB_JSON = "vocab.json"
MERGES_TXT = "merges.txt"


def exportable_backend(tokenizer: Tokenizer):
    """The tokenizer.json an export writes for the run's tokenizer, built (None for a
    HuggingFaceTokenizer, whose files are copied); a ValueError when it has no exact Hugging Face
    form here. Called before an export writes its first file, so a refused export leaves no
    half-written directory."""
    return None if isinstance(tokenizer, HuggingFaceTokenizer) else build_backend(tokenizer)


def eod_text(tokenizer: Tokenizer) -> str:
    """The token string of the tokenizer's eod."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return tokenizer.piece(tokenizer.eod)
    if isinstance(tokenizer, TikTokenizer):
        return tokenizer.special_tokens[tokenizer.eod]
    return str(tokenizer.eod) if isinstance(tokenizer, NullTokenizer) else EOD_TEXT


def build_backend(tokenizer: Tokenizer):
    """A `tokenizers.Tokenizer` that encodes and decodes as `tokenizer` does, eod marked special."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    if isinstance(tokenizer, GPT2BPETokenizer):
        backend = Backend.from_str(tokenizer.backend.to_str())  # a copy: the run's own pipeline
    elif isinstance(tokenizer, ByteTokenizer):
        backend = Backend(models.BPE(vocab=byte_alphabet(), merges=[]))
        # use_regex=False: bytes need no word splitting when nothing merges
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
    elif isinstance(tokenizer, NullTokenizer):
        backend = Backend(models.WordLevel({str(i): i for i in range(tokenizer.eod)}, unk_token=None))  # then the eod
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # decoding joins with spaces
    elif isinstance(tokenizer, SentencePieceTokenizer):
        backend = hf_sentencepiece.sentencepiece_backend(tokenizer.path, tokenizer.kind)
    elif isinstance(tokenizer, TikTokenizer):
        backend = hf_tiktoken.tiktoken_backend(tokenizer)
    else:  # a HuggingFaceTokenizer's files are copied, never rebuilt
        raise ValueError(f"no tokenizers backend is built for a {type(tokenizer).__name__}")
    eod = eod_text(tokenizer)
    backend.add_special_tokens([AddedToken(eod, special=True)])
    if backend.token_to_id(eod) != tokenizer.eod:
        raise ValueError(f"{type(tokenizer).__name__}: {eod!r} is not id {tokenizer.eod}, the eod")
    return backend


def write_tokenizer_files(directory: Path, tokenizer: Tokenizer, backend, max_length: int) -> list[str]:
    """Write the tokenizer files into `directory` (`backend`: exportable_backend's); returns their names."""
    if isinstance(tokenizer, HuggingFaceTokenizer):
        return _copy_hf_files(Path(tokenizer.directory), directory, tokenizer.eos_text)
    written = [TOKENIZER_JSON, TOKENIZER_CONFIG]
    backend.save(str(directory / TOKENIZER_JSON))
    eod = eod_text(tokenizer)
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod, "eos_token": eod,
        "model_max_length": max_length, "split_special_tokens": True, "clean_up_tokenization_spaces": False,
    }  # fmt: skip
    if isinstance(tokenizer, SentencePieceTokenizer):  # its bos and unk named, never added: Megatron adds none
        named = {"bos_token": tokenizer.bos, "unk_token": tokenizer.unk}
        settings.update({key: tokenizer.piece(i) for key, i in named.items() if i >= 0}, add_bos_token=False,
                        add_eos_token=False)  # fmt: skip
    if isinstance(tokenizer, TikTokenizer):  # special-token text is the token, as TikTokenizer encodes it
        named = {"bos_token": tokenizer.bos, "pad_token": tokenizer.pad}
        settings.update({key: tokenizer.special_tokens[i] for key, i in named.items()}, split_special_tokens=False,
                        add_bos_token=False, add_eos_token=False)  # fmt: skip
    if isinstance(tokenizer, GPT2BPETokenizer):
        shutil.copyfile(tokenizer.vocab_file, directory / VOCAB_JSON)
        shutil.copyfile(tokenizer.merge_file, directory / MERGES_TXT)
        settings.update(tokenizer_class="GPT2Tokenizer", unk_token=eod, add_prefix_space=False)
        written += [VOCAB_JSON, MERGES_TXT]
    else:  # BPE files left by an earlier export into this directory would name the wrong tokenizer
        for name in (VOCAB_JSON, MERGES_TXT):
            (directory / name).unlink(missing_ok=True)
    (directory / SPECIAL_TOKENS_MAP).unlink(missing_ok=True)
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
    return written


def _copy_hf_files(src: Path, dst: Path, eos: str) -> list[str]:
    """A HuggingFaceTokenizer's files, copied as they are. Without a tokenizer_config.json a
    minimal one names the fast tokenizer and the eos, so that transformers neither guesses the
    class from config.json's model type nor loses the eod."""
    written = []
    for name in HF_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            written.append(name)
        else:
            (dst / name).unlink(missing_ok=True)
    if TOKENIZER_CONFIG not in written:
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
        (dst / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
        written.append(TOKENIZER_CONFIG)
    for name in (VOCAB_JSON, MERGES_TXT):
        (dst / name).unlink(missing_ok=True)
    return written


def recognise(directory: Path, keep_in: Path) -> dict | None:
    """The `[data]` tokenizer keys of the tokenizer files in `directory`, or None when there are
    none. Any tokenizer.json but dtgpt's byte and null ones is a HuggingFaceTokenizer. Tokenizer
    files are copied into `keep_in`, so the keys outlive `directory`."""
    no_files = {"vocab_file": "", "merge_file": "", "tokenizer_model": ""}
    if (directory / VOCAB_JSON).is_file() and (directory / MERGES_TXT).is_file():
        _copy(directory, keep_in, (VOCAB_JSON, MERGES_TXT))
        return {**no_files, "tokenizer_type": "GPT2BPETokenizer", "vocab_file": str((keep_in / VOCAB_JSON).resolve()),
                "merge_file": str((keep_in / MERGES_TXT).resolve())}  # fmt: skip
    if not (directory / TOKENIZER_JSON).is_file():
        return None
    model = read_json_object(directory / TOKENIZER_JSON, "tokenizer").get("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"{directory / TOKENIZER_JSON}: its 'model' is a JSON {type(model).__name__}, not a tokenizer model object")
    vocab = model.get("vocab") or {}
    if model.get("type") == "BPE" and not model.get("merges") and vocab == byte_alphabet():
        return {**no_files, "tokenizer_type": "ByteTokenizer"}
    if model.get("type") == "WordLevel" and len(vocab) >= 2 and vocab == {str(i): i for i in range(len(vocab))}:
        return {**no_files, "tokenizer_type": "NullTokenizer", "vocab_size": len(vocab)}
    HuggingFaceTokenizer(str(directory))  # unusable files are refused here, named where they are
    _copy(directory, keep_in, [name for name in HF_FILES if (directory / name).is_file()])
    return {**no_files, "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(keep_in.resolve())}


def _copy(src: Path, dst: Path, names) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(src / name, dst / name)
