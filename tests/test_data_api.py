"""The public API the training loop calls: build_tokenizer, build_datasets, build_data_loader."""

import json
import os

import numpy as np
import pytest
import torch

import dtgpt.data.builtin as builtin
from dtgpt.config import Config
from dtgpt.data import build_datasets, build_tokenizer
from dtgpt.data.loader import build_data_loader
from dtgpt.data.indexed import IndexedDatasetWriter


def config(**data):
    cfg = Config()
    cfg.model.seq_length = 32
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def check(dataset, n, seq=32, vocab=None):
    assert len(dataset) >= n
    for i in (0, n // 2, n - 1):
        x = dataset[i]
        assert isinstance(x, np.ndarray) and x.dtype == np.int64 and x.shape == (seq + 1,)
        if vocab:
            assert 0 <= x.min() and x.max() < vocab


def test_mock_data():
    cfg = config(mock_data=True, split="98,2,0")
    tok = build_tokenizer(cfg.data)
    train, valid, test = build_datasets(cfg, tok, (100, 10, 10))
    check(train, 100, vocab=50257)
    check(valid, 10, vocab=50257)
    check(test, 10, vocab=50257)  # Megatron's mock data splits 1,1,1 whatever data.split says
    assert build_datasets(cfg, tok, (100, 0, 0))[1] is None  # 0 samples asked


def test_builtin_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(builtin, "DEFAULT_MAX_BYTES", 100_000)
    cfg = config(builtin_corpus="python-docstrings", data_cache_path=str(tmp_path), split="9,1,0")
    tok = build_tokenizer(cfg.data)
    train, valid, test = build_datasets(cfg, tok, (200, 20, 0))
    check(train, 200, vocab=tok.vocab_size)
    check(valid, 20, vocab=tok.vocab_size)
    assert test is None
    # every piece of a sample between eods is text from the gathered docstrings
    jsonl = os.path.join(os.path.dirname(builtin.corpus_prefix(str(tmp_path), "python-docstrings", 100_000)),
                         "python-docstrings.jsonl")
    corpus = "\x00".join(json.loads(line)["text"] for line in open(jsonl, encoding="utf-8")).encode()
    for i in range(0, 200, 17):
        x = train[i]
        pieces = np.split(x, np.flatnonzero(x == tok.eod))
        assert all(bytes(p[p != tok.eod].astype(np.uint8).tolist()) in corpus for p in pieces)


def test_data_path_through_the_loader(tmp_path):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "corpus", np.uint16) as w:
        for _ in range(100):
            w.add_document(rng.integers(0, 1000, rng.integers(1, 80)))
    cfg = config(data_path=[str(tmp_path / "corpus")], tokenizer_type="NullTokenizer", vocab_size=1000,
                 data_cache_path=str(tmp_path / "cache"), split="90,10,0")
    tok = build_tokenizer(cfg.data)
    train, valid, test = build_datasets(cfg, tok, (64, 8, 0))
    check(train, 64, vocab=1000)
    assert test is None
    batches = list(build_data_loader(train, 16, lambda c: 16, dp_rank=1, dp_size=2, num_workers=1))
    assert len(batches) == len(train) // 16 - 1
    assert batches[0].dtype == torch.int64 and batches[0].shape == (8, 33)
    assert torch.equal(batches[0], torch.from_numpy(np.stack([train[i] for i in range(24, 32)])))


def test_no_data_is_a_clear_error():
    cfg = config()
    with pytest.raises(ValueError, match="no training data"):
        build_datasets(cfg, None, (1, 0, 0))
