"""The tokenizer half of an export (dtgpt/checkpoint/hf_tokenizer.py), without a checkpoint: what it
reads and what it refuses. (AutoTokenizer against dtgpt's ids: tests/test_hf_export.py.)"""

from __future__ import annotations

import pytest

from dtgpt.checkpoint import hf_sentencepiece, hf_tiktoken, hf_tokenizer
from dtgpt.config import DataConfig
from dtgpt.data.tokenizer import build_tokenizer
from tests.tokenizer_files import write_sentencepiece_model, write_tiktoken_vocab


def counted(monkeypatch, module, name: str) -> list:
    """Replace module.name by a wrapper that records each call; returns the record."""
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(args) or original(*args))
    return calls


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "TikTokenizer"])
def test_an_export_reads_the_tokenizer_once(tmp_path, monkeypatch, kind):
    """The check before any file is written and the tokenizer.json written are one build: the
    SentencePiece model file is parsed once (its eod, bos and unk pieces come from the run's own
    processor), the TikTokenizer vocabulary spelled once."""
    pytest.importorskip("tokenizers")
    if kind == "TikTokenizer":
        pytest.importorskip("tiktoken")
        data = {"tokenizer_model": str(write_tiktoken_vocab(tmp_path)), "tiktoken_num_special_tokens": 10, "vocab_size": 290}
        calls = counted(monkeypatch, hf_tiktoken, "_vocabulary")
    else:
        pytest.importorskip("sentencepiece")
        data = {"tokenizer_model": str(write_sentencepiece_model(tmp_path))}
        calls = counted(monkeypatch, hf_sentencepiece, "read_model")
    tokenizer = build_tokenizer(DataConfig(tokenizer_type=kind, **data))
    backend = hf_tokenizer.exportable_backend(tokenizer)
    (tmp_path / "hf").mkdir()
    hf_tokenizer.write_tokenizer_files(tmp_path / "hf", tokenizer, backend, max_length=32)
    assert len(calls) == 1
    assert backend.token_to_id(hf_tokenizer.eod_text(tokenizer)) == tokenizer.eod
