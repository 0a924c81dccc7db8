"""Megatron's SentencePiece tokenizers as a `tokenizers` JSON (tokenizer.json).

The export carries no `.model` file for transformers to convert at load time: transformers'
Llama tokenizer rebuilds a fixed pipeline from it (no normalization, whitespace kept), which is
SentencePiece's only for models trained like Llama's. Here every step is read from the model
itself, so a model trained with SentencePiece's defaults (NFKC, extra spaces removed) comes out
as it encodes too, and loading needs `tokenizers` alone, no sentencepiece or protobuf:

- the model: BPE, its merges ranked by the joined piece's score, the ids the pieces' ids, with
  byte fallback when the model has it. (A Unigram model is refused: `tokenizers`' Unigram would
  choose a control piece such as "</s>" from text whose characters fall back to bytes, which
  SentencePiece never does.)
- the normalizer, in SentencePiece's order: its character map (`Precompiled`), extra spaces
  removed (only the space character, as SentencePiece), the spaces escaped to "▁", then the
  dummy prefix (none for empty text);
- control pieces (<s>, </s>, <pad>) are special tokens: never made from text, shown in a decode.

SentencePiece adds no bos or eos here (Megatron's types add none): the JSON has no
post-processor, so transformers' `add_special_tokens` has nothing to add.
"""

from __future__ import annotations

from pathlib import Path

BPE = 2  # SentencePiece's TrainerSpec.ModelType
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # its SentencePiece.Type
SPACE = "▁"


def read_model(path: str):
    """The model's protobuf (SentencePiece's own schema, run by the protobuf library)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def _unsupported(proto) -> str | None:
    """Why the model has no faithful tokenizer.json here, or None."""
    if proto.trainer_spec.model_type != BPE:
        return "it is not a BPE model (Llama's is; a Unigram model's control pieces would be read from text)"
    if proto.trainer_spec.treat_whitespace_as_suffix:
        return "it treats whitespace as a suffix"
    if proto.denormalizer_spec.precompiled_charsmap:
        return "it has a denormalizer"
    if any(piece.type == USER_DEFINED for piece in proto.pieces):
        return "it has user-defined pieces"
    return None


def _merges(proto) -> list[tuple[str, str]]:
    """SentencePiece's BPE merges the adjacent pair whose joined piece scores highest: as ranked
    merges, every split of a normal piece into two normal pieces, best joined score first."""
    ids = {piece.piece: i for i, piece in enumerate(proto.pieces) if piece.type == NORMAL}
    ranked = []
    for joined, i in ids.items():
        for cut in range(1, len(joined)):
            left, right = joined[:cut], joined[cut:]
            if left in ids and right in ids:
                ranked.append((-proto.pieces[i].score, i, ids[left], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _normalizer(spec):
    from tokenizers import Regex, normalizers

    space = SPACE if spec.escape_whitespaces else " "
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(space))  # Prepend leaves empty text empty, as SentencePiece
    return normalizers.Sequence(steps)


def sentencepiece_backend(path: str, kind: str):
    """A `tokenizers.Tokenizer` that encodes and decodes as the SentencePiece model at `path`; a
    ValueError naming the file when the model has no faithful tokenizer.json here."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    proto = read_model(path)
    problem = _unsupported(proto)
    if problem:
        raise ValueError(f"data.tokenizer_model={path!r}: the {kind}'s SentencePiece model has no Hugging Face form "
                         f"dtgpt writes: {problem}")  # fmt: skip
    trainer, spec = proto.trainer_spec, proto.normalizer_spec
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    backend = Tokenizer(models.BPE(vocab, _merges(proto), unk_token=trainer.unk_piece, fuse_unk=True,
                                   byte_fallback=trainer.byte_fallback))  # fmt: skip
    backend.normalizer = _normalizer(spec)
    steps = [decoders.Replace(SPACE, " ")] if spec.escape_whitespaces else []
    steps += [decoders.ByteFallback(), decoders.Fuse()]
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1))  # the dummy prefix, as SentencePiece's decode drops it
    backend.decoder = decoders.Sequence(steps)
    backend.add_special_tokens([AddedToken(piece.piece, special=True, normalized=False)
                                for piece in proto.pieces if piece.type == CONTROL])  # fmt: skip
    return backend
