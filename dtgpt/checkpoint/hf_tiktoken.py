"""Megatron's TikTokenizer as a `tokenizers` JSON (tokenizer.json): a byte-level BPE.

- the vocabulary: each token's bytes in GPT-2's byte-to-character alphabet, at the id the run
  gave it (the file's rank + the number of special tokens); the special tokens at ids 0..S-1;
- the merges: every split of a token into two tokens, ranked by the joined token's rank, as
  tiktoken merges the adjacent pair whose join ranks lowest; a piece of text that is a whole
  token is that token (`ignore_merges`), as tiktoken takes it;
- the pre-tokenizer: Megatron's pattern (v1 or v2) splits the text, then its bytes are mapped;
- the special tokens: matched in text, as TikTokenizer encodes them (allowed_special="all").
"""

from __future__ import annotations

from dtgpt.checkpoint.byte_alphabet import byte_alphabet


_BYTE_CHAR = {b: c for c, b in byte_alphabet().items()}  # byte -> its character in the byte alphabet


def _spell(token: bytes) -> str:
    return "".join(_BYTE_CHAR[b] for b in token)


def _vocabulary(tokenizer) -> dict[str, int]:
    """The tokenizer.json vocabulary: the special tokens at their ids, then the file's tokens spelled
    in the byte alphabet; a ValueError when a special token's text is also an ordinary token's spelling."""
    spelled = {_spell(token): i for token, i in tokenizer.ranks.items()}
    clash = sorted(set(tokenizer.special_tokens) & set(spelled))
    if clash:
        raise ValueError(f"data.tokenizer_model={tokenizer.path!r}: the TikTokenizer's special tokens {clash} are "
                         "also ordinary tokens of the file, which one tokenizer.json vocabulary cannot hold apart")  # fmt: skip
    return {**{token: i for i, token in enumerate(tokenizer.special_tokens)}, **spelled}


def _merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the joined token's rank first: tiktoken merges the
    adjacent pair whose join ranks lowest."""
    ranked = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                ranked.append((rank, ranks[left], _spell(left), _spell(right)))
    return [(left, right) for *_, left, right in sorted(ranked)]


def tiktoken_backend(tokenizer):
    """A `tokenizers.Tokenizer` that encodes and decodes as the TikTokenizer `tokenizer`; a ValueError
    (from _vocabulary) when it has none."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.BPE(_vocabulary(tokenizer), _merges(tokenizer.ranks), ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in tokenizer.special_tokens])
    return backend
