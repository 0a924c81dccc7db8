"""Mock data: Megatron's mock corpus (tests/test_data_tokens_oracle.py compares the samples with
megatron-core's MockGPTDataset); here the corpus itself and what a run builds from it."""

import numpy as np

from dtgpt import make_config
from dtgpt.data import build_datasets, build_tokenizer
from dtgpt.data.mock import DOCUMENTS, MockDocuments


def test_a_mock_document_counts_up_then_ends_in_eod():
    corpus = MockDocuments(vocab_size=100, eod=99)
    assert len(corpus) == DOCUMENTS and corpus.sequence_lengths.min() >= 1 and corpus.sequence_lengths.max() < 4096
    n = int(corpus.sequence_lengths[7])
    doc = corpus.get(7)
    assert doc.dtype == np.int64 and len(doc) == n and doc[-1] == 99
    np.testing.assert_array_equal(doc[:-1], np.arange(1, n) % 100)
    np.testing.assert_array_equal(corpus.get(7, 3, 5), doc[3:8])
    np.testing.assert_array_equal(corpus.get(7, n - 2), doc[-2:])


def test_mock_splits_are_even_and_cached(tmp_path):
    cfg = make_config(model=dict(seq_length=64), data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128,
                                                           split="98,2,0", data_cache_path=str(tmp_path)))
    train, valid, test = build_datasets(cfg, build_tokenizer(cfg.data), (100, 20, 10))
    assert test is not None  # Megatron's mock data splits 1,1,1 whatever data.split says
    for ds in (train, valid, test):
        assert ds[0].shape == (65,) and ds[0].max() < 128
    assert list((tmp_path / "GPTDataset_indices").glob("*-GPTDataset-train-shuffle_index.npy"))
    again = build_datasets(cfg, build_tokenizer(cfg.data), (100, 20, 10))[0]
    assert all(np.array_equal(train[i], again[i]) for i in range(100))
