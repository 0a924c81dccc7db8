"""The tokenizer keys of [data], with Megatron-LM's names, defaults and meanings.

A base of DataConfig (dtgpt/config/sections.py) so that [data] stays one section, as in
Megatron's args; their rules are dtgpt/config/tokenizer_rules.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenizerKeys:
    tokenizer_type: str = "GPT2BPETokenizer"
    """'GPT2BPETokenizer', 'ByteTokenizer', 'NullTokenizer', 'HuggingFaceTokenizer', the SentencePiece
    types 'SentencePieceTokenizer', 'GPTSentencePieceTokenizer', 'Llama2Tokenizer', or 'TikTokenizer'."""
    vocab_file: str = ""
    merge_file: str = ""
    tokenizer_model: str = ""
    """Megatron's --tokenizer-model: HuggingFaceTokenizer's directory (tokenizer.json, and
    tokenizer_config.json naming the eos token), a SentencePiece .model file, or TikTokenizer's .json."""
    tiktoken_pattern: str = ""
    """TikTokenizer's pre-tokenizer regex, Megatron's 'v1' or 'v2' (unset: v2)."""
    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: the ids below the vocabulary file's tokens, reserved for special tokens."""
    tokenizer_special_tokens: list[str] = field(default_factory=list)
    """TikTokenizer's special tokens, ids 0.. in order (empty: <unk> <s> </s> <mask> <pad> <cls> <sep>)."""
    tokenizer_hf_include_special_tokens: bool = False
    """HuggingFaceTokenizer: encode with the special tokens its post-processor adds (e.g. a BOS),
    as Megatron's --tokenizer-hf-include-special-tokens; off, as Megatron's default."""
    vocab_size: int = 0
    """Vocabulary of NullTokenizer (and of mock data when no tokenizer file is given); TikTokenizer's
    whole vocabulary, special tokens included (0: 2**17, Megatron's)."""
