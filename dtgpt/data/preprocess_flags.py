"""Every flag of Megatron-LM's tools/preprocess_data.py, and what scripts/preprocess_data.py does
with each: takes it (the same meaning), notes it (accepted: it changes nothing in what is
written), or refuses it in one line (its meaning is not built here).

Megatron's pip package (megatron-core) does not ship tools/, so its parser is stored here as
data, read from NVIDIA/Megatron-LM tools/preprocess_data.py `get_args()` (the main branch of
2025: its own groups "input data", "tokenization process", "output data", "runtime"), plus the
tokenizer group it adds with `_add_tokenizer_args`, which is the one train.py's flags already
list (dtgpt/config/megatron_names.py, `vocab-size` through `trust-remote-code`). The packed form
is megatron_names.py's: `name!` store_true, `name*` one or more values, else one value.
"""

from __future__ import annotations

from dtgpt.config.megatron_flags import Flag, megatron_flags

PREPROCESS_FLAGS = """
    input json-keys* split-sentences! keep-newlines! append-eod! lang output-prefix workers
    find-optimal-num-workers! workers-to-check* max-documents performance-dir partitions
    log-interval keep-sequential-samples!
"""
"""tools/preprocess_data.py's own flags, in its parser's order."""

TOKENIZER_GROUP = ("vocab-size", "trust-remote-code")
"""The first and last flag of Megatron's tokenizer group in megatron_names.py's list."""

TAKEN = (
    "input", "json-keys", "append-eod", "output-prefix", "workers", "vocab-size", "vocab-file", "merge-file",
    "tokenizer-type", "tokenizer-model", "tokenizer-hf-include-special-tokens", "tiktoken-pattern",
    "tiktoken-num-special-tokens", "tiktoken-special-tokens", "tokenizer-special-tokens",
)  # fmt: skip
"""Flags preprocess_data.py reads with Megatron's meaning."""

NOTED = {
    "keep-newlines": "only matters when splitting sentences (--split-sentences), as in Megatron",
    "lang": "names the language of NLTK's sentence splitter, used only with --split-sentences",
    "partitions": "Megatron splits the input into files for parallel processes; here the --workers processes share one "
                  "file and the output is the same",
    "keep-sequential-samples": "the documents are always written in input order here",
    "log-interval": "progress is printed every few seconds (every 0.5 s on a terminal) instead of every N documents",
    "workers-to-check": "only used by --find-optimal-num-workers",
    "max-documents": "only used by --find-optimal-num-workers",
    "performance-dir": "only used by --find-optimal-num-workers",
    "padded-vocab-size": "preprocessing writes token ids; padding the vocabulary is the model's (model.make_vocab_size_divisible_by)",
    "vocab-extra-ids": "Megatron's preprocess_data.py resets it to 0 itself",
    "legacy-tokenizer": "chooses between Megatron's two tokenizer code bases, which give the same ids for this "
                        "tokenizer type (beside SentencePieceTokenizer, Llama2Tokenizer or TikTokenizer it is refused)",
    "tokenizer-hf-use-fast": "HuggingFaceTokenizer always uses the `tokenizers` library (the fast tokenizer)",
    "trust-remote-code": "a tokenizer.json is data: no tokenizer code is ever run here",
}  # fmt: skip
"""Flags accepted with one note each: what is written does not change."""

REFUSED = {
    "split-sentences": "splits each document into sentences (Megatron uses NLTK's punkt and writes *_sentence "
                       "datasets for BERT/T5-style models); no sentence splitter is built here: GPT trains on whole "
                       "documents, so leave it out",
    "find-optimal-num-workers": "is Megatron's benchmark of worker counts, not built here: time runs with --workers N "
                                "(the last line prints MB/s and tokens/s)",
    "tokenizer-metadata": "configures Megatron's tokenizer library, not built here: give the tokenizer's files "
                          "(--vocab-file/--merge-file or --tokenizer-model)",
    "tokenizer-sentencepiece-legacy": "is Megatron's legacy SentencePiece wrapper (special tokens added by the "
                                      "wrapper), not built here: a .model file carries its own special tokens",
}  # fmt: skip
"""Flags whose meaning is not built: refused in one line."""

LEGACY_DIFFERS = ("SentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer")
"""The types whose legacy Megatron class (--legacy-tokenizer) encodes otherwise than its tokenizer
library: its Llama2Tokenizer adds a bos, its SentencePieceTokenizer adds special tokens to the
vocabulary, its TikTokenizer encodes special-token text as ordinary text. Refused beside them."""


def check_legacy_tokenizer(legacy: bool, tokenizer_type: str) -> None:
    if legacy and tokenizer_type in LEGACY_DIFFERS:
        raise ValueError(f"--legacy-tokenizer is refused beside --tokenizer-type {tokenizer_type}: Megatron's legacy "
                         "class for it gives other ids than its tokenizer library, which is built here (leave the flag out)")


def preprocess_flags() -> dict[str, Flag]:
    """Megatron's preprocess_data.py flags by name (its own, then its tokenizer group)."""
    flags = {}
    for spec in PREPROCESS_FLAGS.split():
        name, arity, stores = spec, "1", None
        if spec.endswith("!"):
            name, arity, stores = spec[:-1], "0", True
        elif spec.endswith("*"):
            name, arity = spec[:-1], "*"
        flags[name] = Flag(name, name.replace("-", "_"), arity, stores)
    names = list(megatron_flags())
    first, last = (names.index(n) for n in TOKENIZER_GROUP)
    flags.update({n: megatron_flags()[n] for n in names[first : last + 1]})
    return flags
