"""The tokenizer types of `[data]`, the optional library each needs, and the rules of their keys.

Megatron's SentencePiece types (SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer)
read a SentencePiece `.model` file; TikTokenizer reads a tiktoken-style vocabulary `.json` (a list
of {rank, token_bytes, token_str}) with special tokens at the ids below it. A missing library is
found here, before any process group exists; the files are read when the tokenizer is built.
"""

from __future__ import annotations

import importlib.util

from dtgpt.config.derived import null_tokenizer_ids, padded_vocabulary
from dtgpt.config.sections import Config, require

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
"""Megatron builds all three as one SentencePiece tokenizer (megatron/core/tokenizers)."""

TOKENIZER_TYPES = ("GPT2BPETokenizer", "ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES,
                   "TikTokenizer")  # fmt: skip

LIBRARIES = {
    "GPT2BPETokenizer": ("tokenizers", "gpt2"),
    "HuggingFaceTokenizer": ("tokenizers", "gpt2"),
    **{kind: ("sentencepiece", "sentencepiece") for kind in SENTENCEPIECE_TYPES},
    "TikTokenizer": ("tiktoken", "tiktoken"),
}
"""tokenizer type -> (the library it runs on, the pip extra of dtgpt that installs it)."""

TIKTOKEN_PATTERNS = ("", "v1", "v2")
"""Megatron's --tiktoken-pattern choices; unset is v2, Megatron's default."""

TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
"""Megatron's TikTokenizer special tokens (ids 0..6 unless --tokenizer-special-tokens reorders them);
eod is the id of </s>."""

TIKTOKEN_DEFAULT_VOCAB = 2**17
"""TikTokenizer's vocabulary (special tokens included) when --vocab-size is not given, as Megatron's."""


def missing_library_message(kind: str) -> str | None:
    """The one line for a tokenizer type whose library is not installed; None when it is."""
    library, extra = LIBRARIES.get(kind, (None, None))
    if library is None or importlib.util.find_spec(library) is not None:
        return None
    return f"{kind} needs the '{library}' library: pip install 'dtgpt[{extra}]'"


def tiktoken_special_tokens(special: list[str], num_special: int, vocab_size: int) -> list[str]:
    """TikTokenizer's special tokens, ids 0..num_special-1: the given ones (Megatron's seven when
    none), then <SPECIAL_i> fillers; a ValueError naming the key when Megatron would refuse them."""
    given = list(special) or list(TIKTOKEN_SPECIAL_TOKENS)
    twice = sorted({t for t in given if given.count(t) > 1})
    if twice:
        raise ValueError(f"data.tokenizer_special_tokens names {twice} more than once; each is one id")
    missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in given]
    if missing:
        raise ValueError(f"data.tokenizer_special_tokens={given} lacks {missing}: TikTokenizer needs all of "
                         f"{list(TIKTOKEN_SPECIAL_TOKENS)} (Megatron's rule)")  # fmt: skip
    if not len(given) <= num_special < vocab_size:
        raise ValueError(
            f"data.tiktoken_num_special_tokens={num_special} must be at least the {len(given)} special tokens "
            f"and below the vocabulary, data.vocab_size={vocab_size} (TikTokenizer's rule, as Megatron's)"
        )
    return given + [f"<SPECIAL_{i}>" for i in range(len(given), num_special)]


def check_tokenizer(d) -> None:
    """The rules of `[data]`'s tokenizer keys that need no file (d: a DataConfig)."""
    kind = d.tokenizer_type
    require(d.tiktoken_pattern in TIKTOKEN_PATTERNS, f"data.tiktoken_pattern={d.tiktoken_pattern!r} is not one of "
            "Megatron's patterns: 'v1', 'v2' (unset: v2)")  # fmt: skip
    needs_model = {"HuggingFaceTokenizer": "the directory of its tokenizer.json", "TikTokenizer": "its vocabulary .json",
                   **{t: "its SentencePiece .model file" for t in SENTENCEPIECE_TYPES}}  # fmt: skip
    if kind in needs_model:
        require(bool(d.tokenizer_model), f"data.tokenizer_type={kind!r} needs data.tokenizer_model, {needs_model[kind]} "
                "(Megatron's --tokenizer-model)")  # fmt: skip
    if kind in SENTENCEPIECE_TYPES or kind == "TikTokenizer":  # the types whose library is only an extra
        message = missing_library_message(kind)
        require(message is None, f"data.tokenizer_type={kind!r}: {message}")
    if kind != "TikTokenizer":
        # Megatron adds them to a SentencePiece model only in its legacy wrapper, and to GPT-2 BPE and Hugging
        # Face tokenizers as extra tokens: neither is built here
        require(not d.tokenizer_special_tokens, f"data.tokenizer_special_tokens={d.tokenizer_special_tokens} is refused "
                f"for {kind}: dtgpt reads special tokens for TikTokenizer only; a tokenizer file carries its own")  # fmt: skip
    if kind == "TikTokenizer":
        try:
            tiktoken_special_tokens(d.tokenizer_special_tokens, d.tiktoken_num_special_tokens,
                                    d.vocab_size or TIKTOKEN_DEFAULT_VOCAB)  # fmt: skip
        except ValueError as e:
            require(False, str(e))


def check_tokenizer_config(cfg: Config) -> None:
    """The rules of `[data]`'s tokenizer keys in a whole config: check_tokenizer's, and the vocabulary
    of NullTokenizer and of mock data, known (and padded) before any file is read."""
    d = cfg.data
    mock_null = d.mock_data and d.tokenizer_type == "GPT2BPETokenizer" and not (d.vocab_file or d.merge_file) and d.vocab_size
    if d.tokenizer_type == "NullTokenizer" or mock_null:  # mock data's vocab_size counts the eod: one id needs 2
        least = 2 if d.mock_data else 1
        require(d.vocab_size >= least, f"data.vocab_size={d.vocab_size} must be >= {least} for {d.tokenizer_type}"
                + (" on mock data (the whole vocabulary, the eod its last id)" if d.mock_data else ""))  # fmt: skip
    check_tokenizer(d)
    if d.tokenizer_type == "NullTokenizer":
        padded_vocabulary(cfg, null_tokenizer_ids(d) + 1)  # known now (ids + eod); others once the tokenizer is built
