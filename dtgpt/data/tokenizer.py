"""Tokenizers: GPT-2 BPE from vocab.json + merges.txt, Hugging Face tokenizer files, a byte
tokenizer, a null tokenizer, and (in their own files) Megatron's SentencePiece and TikTokenizer.

All share one small interface: `.vocab_size`, `.eod`, `.tokenize(text) -> list[int]`,
`.detokenize(ids) -> str`. `build_tokenizer(data_cfg)` picks one from the `[data]` section.
"""

from __future__ import annotations

import os
from typing import Iterable, Protocol, runtime_checkable

from dtgpt.config import DataConfig
from dtgpt.config.derived import null_tokenizer_ids
from dtgpt.config.tokenizer_rules import SENTENCEPIECE_TYPES, TOKENIZER_TYPES
from dtgpt.data.indexed import DataError, DataFileNotFoundError
from dtgpt.data.libraries import PickledAsArguments, import_library, json_file
from dtgpt.data.sentencepiece_tokenizer import SentencePieceTokenizer
from dtgpt.data.tiktoken_tokenizer import TikTokenizer

EOD_TEXT = "<|endoftext|>"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GPT2_VOCAB_SIZE = 50257
"""GPT-2's vocabulary (50,000 merges + 256 bytes + <|endoftext|>); mock data's default vocabulary."""


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, eod = 256: no files, every text round-trips."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i <= self.eod]
        if bad:
            raise ValueError(f"ByteTokenizer: ids {bad[:5]} are outside [0, {self.eod}]")
        # eod separates documents; it has no text of its own.
        return bytes(i for i in ids if i != self.eod).decode("utf-8", errors="replace")


class NullTokenizer:
    """Text is already token ids separated by spaces, as Megatron's: ids in [0, vocab_size), and
    eod = vocab_size after them, so the vocabulary holds vocab_size + 1 entries."""

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs vocab_size >= 1, got {vocab_size}")
        self.eod = int(vocab_size)
        self.vocab_size = self.eod + 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer: text must be space-separated integers ({e})") from None
        bad = [i for i in ids if not 0 <= i < self.eod]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} are outside [0, {self.eod})")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class GPT2BPETokenizer(PickledAsArguments):
    """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`, run by the `tokenizers` library."""

    def __init__(self, vocab_file: str, merge_file: str):
        for key, path in (("data.vocab_file", vocab_file), ("data.merge_file", merge_file)):
            if not path:
                raise ValueError(f"GPT2BPETokenizer needs {key} (GPT-2's vocab.json / merges.txt); it is not set")
            if not os.path.isfile(path):
                raise DataFileNotFoundError(
                    f"{key}={path!r}: {'a directory, not a file' if os.path.isdir(path) else 'no such file'} (GPT2BPETokenizer reads GPT-2's vocab.json and merges.txt, which "
                    "dtgpt does not download: docs/data.md; data.tokenizer_type ByteTokenizer or NullTokenizer needs no files)"
                )
        tokenizers = import_library("GPT2BPETokenizer")
        try:
            model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:
            # e.g. a merges.txt of another vocabulary: "Token `ab` out of vocabulary"
            raise DataError(f"cannot read GPT-2 BPE files {vocab_file!r} / {merge_file!r}: {e}") from None
        tok = tokenizers.Tokenizer(model)
        # GPT-2 splits with its regex and maps bytes to printable characters; no leading space added.
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        eod = tok.token_to_id(EOD_TEXT)
        if eod is None:
            raise DataError(f"{vocab_file}: has no {EOD_TEXT} token, which GPT-2 uses as end of document")
        self._tok = tok
        self.vocab_size = _contiguous_vocabulary(tok, f"{vocab_file}: ", "vocab.json is not a GPT-2 vocabulary")
        self.eod = eod
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self._arguments = (vocab_file, merge_file)

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` that encodes (for exporting it, e.g. to Hugging Face)."""
        return self._tok

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HuggingFaceTokenizer(PickledAsArguments):
    """Megatron's HuggingFaceTokenizer: a directory of Hugging Face tokenizer files, run by the
    `tokenizers` library.

    As megatron-core's (which reads the same files with transformers' AutoTokenizer): vocab_size
    counts every token (`len(tokenizer)`), eod is the eos token that tokenizer_config.json (or
    special_tokens_map.json) names, else the sep token, and text is encoded without the special
    tokens the post-processor adds (a BOS, say) unless `include_special_tokens`. Truncation or
    padding stored in tokenizer.json is switched off, as transformers encodes: no document is cut.
    Special-token text in a document is the token, unless tokenizer_config.json sets
    split_special_tokens: then it is ordinary text, as transformers reads it.
    """

    def __init__(self, directory: str, include_special_tokens: bool = False):
        where = f"data.tokenizer_model={directory!r}"
        if not directory:
            raise ValueError("HuggingFaceTokenizer needs data.tokenizer_model (the directory of its tokenizer.json); it is not set")
        if os.path.isfile(directory):
            raise DataError(f"{where} is a file: name the directory that holds tokenizer.json (Megatron's --tokenizer-model)")
        path = os.path.join(directory, TOKENIZER_JSON)
        if not os.path.isfile(path):
            problem = "holds no tokenizer.json" if os.path.isdir(directory) else "no such directory"
            raise DataFileNotFoundError(
                f"{where}: {problem} (HuggingFaceTokenizer reads the tokenizer.json and tokenizer_config.json "
                "that Hugging Face saves; dtgpt downloads nothing)"
            )
        tokenizers = import_library("HuggingFaceTokenizer")
        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library's parse errors have no common class
            raise DataError(f"cannot read {path}: {e}") from None
        tok.no_truncation()
        tok.no_padding()
        special = _special_tokens(directory)
        tok.encode_special_tokens = special["split_special_tokens"]
        eos = special["eos_token"] or special["sep_token"]
        if not eos:
            raise DataError(
                f"{where}: no eos_token in {TOKENIZER_CONFIG} or {SPECIAL_TOKENS_MAP}; "
                "HuggingFaceTokenizer ends documents with the eos token, as Megatron's"
            )
        eod = tok.token_to_id(eos)
        if eod is None:
            raise DataError(f"{where}: the eos_token {eos!r} is not a token of its tokenizer.json")
        self._tok = tok
        self.vocab_size = _contiguous_vocabulary(tok, f"{path}: ", "the model's embedding rows are the token count")
        self.eod = eod
        self.eos_text = eos
        self.directory, self.include_special_tokens = directory, include_special_tokens
        self._arguments = (directory, include_special_tokens)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.include_special_tokens).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _contiguous_vocabulary(tok, where: str, why: str) -> int:
    """The token count, when the ids are 0..count-1: a larger id would index past the embedding."""
    size, largest = tok.get_vocab_size(with_added_tokens=True), max(tok.get_vocab(with_added_tokens=True).values())
    if largest + 1 != size:
        raise DataError(f"{where}token ids are not 0..{size - 1} ({size} tokens, largest id {largest}): {why}")
    return size


def _json_object(path: str) -> dict:
    """A JSON file's object, {} when the file is absent."""
    return json_file(path, dict, "an object") if os.path.isfile(path) else {}


def _special_tokens(directory: str) -> dict[str, str | bool | None]:
    """The eos and sep tokens' text as transformers reads them: from tokenizer_config.json, where
    special_tokens_map.json overrides unless the config lists its added tokens (the legacy layout);
    and the config's split_special_tokens (special-token text read as ordinary text)."""
    config = _json_object(os.path.join(directory, TOKENIZER_CONFIG))
    found = config if "added_tokens_decoder" in config else {**config, **_json_object(os.path.join(directory, SPECIAL_TOKENS_MAP))}
    tokens = {key: found.get(key) for key in ("eos_token", "sep_token")}
    return {key: token.get("content") if isinstance(token, dict) else token for key, token in tokens.items()} | {
        "split_special_tokens": bool(config.get("split_special_tokens", False))}  # fmt: skip


def build_tokenizer(data_cfg: DataConfig) -> Tokenizer:
    """The tokenizer `[data]` asks for.

    - `builtin_corpus` is byte-tokenized when built, so it always uses ByteTokenizer (validation
      refuses another tokenizer named beside it: dtgpt/config/precedence.py).
    - Under `mock_data = true` no file is read, and `data.vocab_size` is the whole vocabulary,
      eod its last id: a NullTokenizer of vocab_size - 1 ids. GPT2BPETokenizer with no vocab_file
      becomes one too, of GPT-2's 50257 entries (eod 50256, GPT-2's) when vocab_size is 0.
    - HuggingFaceTokenizer, the SentencePiece types and TikTokenizer always read their files (under
      mock data too), as Megatron's (dtgpt/data/sentencepiece_tokenizer.py, tiktoken_tokenizer.py).
    """
    kind = data_cfg.tokenizer_type
    if data_cfg.builtin_corpus:
        return ByteTokenizer()
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        if data_cfg.vocab_size <= 0:
            raise ValueError(f"data.tokenizer_type='NullTokenizer' needs data.vocab_size > 0 (got {data_cfg.vocab_size})")
        return NullTokenizer(null_tokenizer_ids(data_cfg))
    if kind == "GPT2BPETokenizer":
        if data_cfg.mock_data and not data_cfg.vocab_file and not data_cfg.merge_file:
            return NullTokenizer((data_cfg.vocab_size or GPT2_VOCAB_SIZE) - 1)
        return GPT2BPETokenizer(data_cfg.vocab_file, data_cfg.merge_file)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(data_cfg.tokenizer_model, data_cfg.tokenizer_hf_include_special_tokens)
    if kind in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(data_cfg.tokenizer_model, kind)
    if kind == "TikTokenizer":
        return TikTokenizer(data_cfg.tokenizer_model, data_cfg.tiktoken_pattern, data_cfg.tiktoken_num_special_tokens,
                            data_cfg.tokenizer_special_tokens, data_cfg.vocab_size)  # fmt: skip
    raise ValueError(f"data.tokenizer_type={kind!r} is not one of: {', '.join(map(repr, TOKENIZER_TYPES))}")
