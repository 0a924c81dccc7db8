"""Megatron's SentencePiece tokenizers (SentencePieceTokenizer, GPTSentencePieceTokenizer,
Llama2Tokenizer): a SentencePiece `.model` file, run by the `sentencepiece` library.

Megatron builds the three types alike (megatron/core/tokenizers, without its legacy wrapper): the
vocabulary is the model's pieces, eod is the model's eos piece, and text is encoded as the model
encodes it, with no bos or eos added; special-token text such as "</s>" inside a document is
ordinary text, as it is there.
"""

from __future__ import annotations

from typing import Iterable

from dtgpt.data.indexed import DataError
from dtgpt.data.libraries import PickledAsArguments, import_library, model_file


class SentencePieceTokenizer(PickledAsArguments):
    def __init__(self, path: str, kind: str = "SentencePieceTokenizer"):
        model_file(kind, path, "a SentencePiece .model file")
        sentencepiece = import_library(kind)
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.Load(path)
        except Exception as e:  # the library's parse errors have no common class
            raise DataError(f"data.tokenizer_model={path!r} is not a SentencePiece model ({kind}): {e}") from None
        if processor.eos_id() < 0:
            raise DataError(f"data.tokenizer_model={path!r}: the SentencePiece model has no eos piece (trained with "
                            f"eos_id=-1), and {kind} ends documents with it, as Megatron's")  # fmt: skip
        self._sp = processor
        self.vocab_size = processor.get_piece_size()
        self.eod = processor.eos_id()
        self.bos = processor.bos_id()  # -1 when the model has none, as Megatron reports it
        self.pad = processor.pad_id()
        self.unk = processor.unk_id()
        self.path, self.kind = path, kind
        self._arguments = (path, kind)

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode_as_ids(text)

    def piece(self, token_id: int) -> str:
        """The model's piece of id `token_id` (e.g. "</s>", the eod's)."""
        return self._sp.id_to_piece(token_id)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])
