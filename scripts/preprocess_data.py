#!/usr/bin/env python
"""Tokenize a JSONL file into Megatron-format indexed datasets, with Megatron's flag names.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --append-eod --workers 8

writes data/corpus_text_document.bin/.idx; use `data_path = ["data/corpus_text_document"]`.
Every flag of Megatron's tools/preprocess_data.py is taken: with its meaning, or with one note
where it changes nothing here, or refused in one line where its meaning is not built
(dtgpt/data/preprocess_flags.py says which).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import dtgpt  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.cli import os_error_line, print_error
from dtgpt.config import DataConfig
from dtgpt.config.tokenizer_rules import TIKTOKEN_PATTERNS, TOKENIZER_TYPES, check_tokenizer
from dtgpt.data.preprocess import PreprocessError, preprocess
from dtgpt.data.preprocess_flags import NOTED, REFUSED, check_legacy_tokenizer, preprocess_flags


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one dataset each")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file", default="", help="GPT-2 vocab.json")
    p.add_argument("--merge-file", default="", help="GPT-2 merges.txt")
    p.add_argument("--tokenizer-model", default="", help="HuggingFaceTokenizer: the directory of its tokenizer.json; "
                   "a SentencePiece type: its .model file; TikTokenizer: its vocabulary .json")
    p.add_argument("--tiktoken-pattern", default="", choices=TIKTOKEN_PATTERNS[1:], help="TikTokenizer's regex (default v2)")
    p.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer: ids reserved for special tokens")
    p.add_argument("--tokenizer-special-tokens", nargs="+", default=[],
                   help="TikTokenizer's special tokens (default: <unk> <s> </s> <mask> <pad> <cls> <sep>)")
    p.add_argument("--tiktoken-special-tokens", nargs="+", default=[], help="Megatron's older --tokenizer-special-tokens")
    p.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: add the special tokens its post-processor adds (e.g. a BOS)")
    p.add_argument("--vocab-size", type=int, default=0, help="NullTokenizer: ids below it, eod = vocab_size (Megatron's); TikTokenizer: "
                   "the whole vocabulary (default 2**17)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--strict", action="store_true", help="refuse the file on any bad line (nothing written)")
    for name in [*NOTED, *REFUSED]:  # Megatron's other flags: noted or refused after parsing
        flag = preprocess_flags()[name]
        kind = {"0": {"action": "store_true"}, "*": {"nargs": "+"}}.get(flag.arity, {})
        p.add_argument(f"--{name}", **kind, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def megatron_only_flags(args: argparse.Namespace) -> list[str]:
    """The note of each given Megatron flag that changes nothing here; a ValueError naming the
    first given one whose meaning is not built."""
    given = [name for name in [*NOTED, *REFUSED] if getattr(args, name.replace("-", "_")) not in (None, False)]
    for name in given:
        if name in REFUSED:
            raise ValueError(f"--{name} {REFUSED[name]}")
    return [f"note: --{name} changes nothing here: {NOTED[name]}" for name in given]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        notes = megatron_only_flags(args)
        check_legacy_tokenizer(bool(args.legacy_tokenizer), args.tokenizer_type)
        duplicate = next((key for i, key in enumerate(args.json_keys) if key in args.json_keys[:i]), None)
        if duplicate is not None:
            raise ValueError(f"--json-keys names {duplicate!r} twice: each key writes one dataset ({args.json_keys})")
    except ValueError as e:
        print_error(str(e))
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    data_cfg = DataConfig(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                          vocab_size=args.vocab_size, tokenizer_model=args.tokenizer_model,
                          tokenizer_hf_include_special_tokens=args.tokenizer_hf_include_special_tokens,
                          tiktoken_pattern=args.tiktoken_pattern, tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                          tokenizer_special_tokens=args.tokenizer_special_tokens or args.tiktoken_special_tokens)
    try:
        check_tokenizer(data_cfg)  # train.py's rules of these keys: a missing library or a misplaced flag, one line
        stats = preprocess(args.input, args.output_prefix, data_cfg, json_keys=args.json_keys,
                           append_eod=args.append_eod, workers=args.workers, strict=args.strict)
    except (PreprocessError, ValueError, FileNotFoundError, ImportError) as e:
        print_error(str(e))
        return 2
    except OSError as e:  # an output prefix in a directory that is missing or not writable
        print_error(os_error_line(e))
        return 2
    print(stats.summary())
    for out in stats.outputs:
        print(f"wrote {out}.bin and {out}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
