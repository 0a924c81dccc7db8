"""Tiny tokenizer files made in the test, no downloads: a SentencePiece model (the `sentencepiece`
trainer) and a TikTokenizer vocabulary .json in Megatron's layout (tiktoken's own BPE trainer)."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

LINES = [
    f"{i} The quick brown fox jumps over the lazy dog; héllo wörld ✓ and {word} again, HelloWorld."
    for i, word in enumerate(["tokenizer", "sentence", "piece", "merges", "vocabulary", "documents"] * 50)
]  # a few hundred lines: the trainers finish in well under a second


def write_sentencepiece_model(directory: Path, vocab_size: int = 400, eos_id: int = 2, **options) -> Path:
    """A BPE SentencePiece model with unk 0, bos 1, eos 2 (or none: -1) and pad 3, with the
    trainer's other `options` (its normalization, say); returns its path."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    prefix = directory / "tokenizer"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES), model_prefix=str(prefix), vocab_size=vocab_size,
        character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1, eos_id=eos_id, pad_id=3, minloglevel=2,
        **{"model_type": "bpe", **options},
    )  # fmt: skip
    return prefix.with_suffix(".model")


@functools.lru_cache(maxsize=None)
def _tiktoken_ranks(vocab_size: int) -> dict[bytes, int]:
    """tiktoken's BPE trained on LINES (about a second: trained once per test process)."""
    from tiktoken._educational import bpe_train

    from dtgpt.data.tiktoken_tokenizer import PATTERNS

    # trained with the v1 regex, which keeps "HelloWorld" one word: v2 splits it, so the two patterns give other ids
    return bpe_train("\n".join(LINES) + " HelloWorld" * 200, vocab_size, PATTERNS["v1"], visualise=None)


def write_tiktoken_vocab(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE of vocab_size tokens (the 256 bytes first) as Megatron's TikTokenizer reads
    it: a list of {rank, token_bytes (base64), token_str}; returns its path."""
    ranks = _tiktoken_ranks(vocab_size)
    entries = [
        {"rank": rank, "token_bytes": base64.b64encode(token).decode("ascii"), "token_str": token.decode("utf-8", "replace")}
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(json.dumps(entries))
    return path
