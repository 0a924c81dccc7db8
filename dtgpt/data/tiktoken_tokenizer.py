"""Megatron's TikTokenizer: a tiktoken-style vocabulary `.json`, run by the `tiktoken` library.

The file is a list of {"rank", "token_bytes" (base64), "token_str"}, rank i at index i, the first
256 the single bytes. As Megatron's (megatron/core/tokenizers): ids 0..S-1 are the special tokens
(data.tokenizer_special_tokens, then <SPECIAL_i> fillers up to data.tiktoken_num_special_tokens = S),
the file's first V - S tokens follow at ids S.. (V = data.vocab_size, default 2**17, the whole
vocabulary), eod is the id of </s>, and special-token text inside a document encodes as its id.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Iterable

from dtgpt.config.tokenizer_rules import TIKTOKEN_DEFAULT_VOCAB, tiktoken_special_tokens
from dtgpt.data.indexed import DataError
from dtgpt.data.libraries import PickledAsArguments, import_library, json_file, model_file

KIND = "TikTokenizer"
ENTRY_KEYS = {"rank", "token_bytes", "token_str"}

# Megatron's two pre-tokenizer regexes (megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py).
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}  # fmt: skip


def read_ranks(path: str, count: int, first_id: int) -> dict[bytes, int]:
    """The file's first `count` tokens -> ids from `first_id` on; a DataError for a file that is
    not such a vocabulary or holds fewer tokens."""
    where = f"data.tokenizer_model={path!r}"
    if not path.endswith(".json"):
        raise DataError(f"{where}: {KIND} reads a vocabulary .json (a list of rank, token_bytes, token_str), as Megatron's")
    entries = json_file(path, list, f"{KIND}'s list of tokens")
    if len(entries) < count:
        raise DataError(f"{where} holds {len(entries)} tokens: {KIND}'s vocabulary of {count + first_id} with {first_id} "
                        f"special tokens needs {count}; set data.vocab_size to at most {len(entries) + first_id}")  # fmt: skip
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries[:count]):
        if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS or entry["rank"] != i:
            raise DataError(f"{where}: token {i} is not {{rank: {i}, token_bytes, token_str}}: {str(entry)[:80]}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError):
            raise DataError(f"{where}: token {i}'s token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise DataError(f"{where}: token {i} must be the byte {i} (the first 256 tokens are the bytes)")
        if token in ranks:
            raise DataError(f"{where}: tokens {ranks[token] - first_id} and {i} are the same bytes {token!r}")
        ranks[token] = i + first_id
    return ranks


class TikTokenizer(PickledAsArguments):
    def __init__(self, path: str, pattern: str = "", num_special_tokens: int = 1000,
                 special_tokens: Iterable[str] = (), vocab_size: int = 0):  # fmt: skip
        model_file(KIND, path, "a tiktoken vocabulary .json")
        tiktoken = import_library(KIND)
        self.vocab_size = vocab_size or TIKTOKEN_DEFAULT_VOCAB
        try:
            specials = tiktoken_special_tokens(list(special_tokens), num_special_tokens, self.vocab_size)
        except ValueError as e:
            raise DataError(str(e)) from None
        if pattern not in ("", *PATTERNS):
            raise DataError(f"data.tiktoken_pattern={pattern!r} is not one of Megatron's patterns: 'v1', 'v2'")
        ranks = read_ranks(path, self.vocab_size - num_special_tokens, num_special_tokens)
        self._encoding = tiktoken.Encoding(
            name=Path(path).parent.name, pat_str=PATTERNS[pattern or "v2"], mergeable_ranks=ranks,
            special_tokens={token: i for i, token in enumerate(specials)},
        )  # fmt: skip
        self.eod, self.bos, self.pad = (specials.index(t) for t in ("</s>", "<s>", "<pad>"))
        # what an export rebuilds the encoding from (dtgpt/checkpoint/hf_tiktoken.py)
        self.path, self.ranks, self.special_tokens, self.pattern = path, ranks, specials, PATTERNS[pattern or "v2"]
        self._arguments = (path, pattern, num_special_tokens, tuple(special_tokens), vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])
