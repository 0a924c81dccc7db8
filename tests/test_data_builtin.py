"""The built-in stdlib-docstring corpus: built through the real preprocessing path, cached, deterministic."""

import os

import numpy as np
import pytest

from dtgpt.data import builtin
from dtgpt.data.builtin import build_builtin_corpus, gather_docstrings
from dtgpt.data.indexed import IndexedDataset
from dtgpt.data.tokenizer import ByteTokenizer

CAP = 150_000


def test_builds_once_and_is_deterministic(tmp_path, monkeypatch):
    prefix = build_builtin_corpus(str(tmp_path / "a"), max_bytes=CAP)
    ds = IndexedDataset(prefix)
    tok = ByteTokenizer()
    assert ds.dtype == np.uint16 and len(ds) > 50
    assert ds.num_tokens - len(ds) <= CAP  # docstring bytes within the cap, plus one eod each
    assert int(ds.sequence_lengths.min()) >= 2
    for i in (0, len(ds) // 2, len(ds) - 1):
        doc = ds[i]
        assert doc[-1] == tok.eod and (doc[:-1] < 256).all()
    first = tok.detokenize(ds[0])
    assert first == next(gather_docstrings(os.path.dirname(os.__file__), CAP))
    # cached: a second call gathers nothing (any gathering fails it) and leaves the files alone
    mtime = os.stat(prefix + ".idx").st_mtime_ns
    with monkeypatch.context() as m:
        m.setattr(builtin, "gather_docstrings", lambda *_: pytest.fail("the cached corpus was gathered again"))
        assert build_builtin_corpus(str(tmp_path / "a"), max_bytes=CAP) == prefix
    assert os.stat(prefix + ".idx").st_mtime_ns == mtime
    # deterministic: an independent build is byte-identical
    other = build_builtin_corpus(str(tmp_path / "b"), max_bytes=CAP)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(other + ext, "rb").read()


def test_cache_key_has_version_and_cap(tmp_path):
    a = build_builtin_corpus(str(tmp_path), max_bytes=20_000)
    b = build_builtin_corpus(str(tmp_path), max_bytes=40_000)
    assert a != b and "cap20000" in a and f"{os.sys.version_info[0]}.{os.sys.version_info[1]}" in a
    assert IndexedDataset(a).num_tokens < IndexedDataset(b).num_tokens
