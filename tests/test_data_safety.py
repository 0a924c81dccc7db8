"""Data files that used to be read silently wrong (issue 21): a wrong dtype code in the `.idx`,
a tampered index cache (one whose checksum was rewritten to match too: issue 35), and a
preprocessing input that yields no document."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest

from dtgpt.config import DataConfig
from dtgpt.data.gpt_dataset import GPTDataset
from dtgpt.data.indexed import DataError, IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, dtype_code
from dtgpt.data.preprocess import PreprocessError, preprocess

DTYPE_CODE_OFFSET = 9 + 8  # after the magic and the version


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    prefix = tmp_path / "docs"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(30):
            w.add_document(rng.integers(0, 60000, rng.integers(5, 40)))
    return prefix


@pytest.mark.parametrize("wrong", [np.int8, np.uint8])
def test_a_wrong_dtype_code_is_refused_not_misread(corpus, wrong):
    with open(f"{corpus}.idx", "r+b") as f:
        f.seek(DTYPE_CODE_OFFSET)
        f.write(bytes([dtype_code(wrong)]))
    with pytest.raises(IndexedDatasetError, match=r"docs.bin: \d+ bytes, but the sequences of .* end at byte .*wrong dtype code"):
        IndexedDataset(corpus)


def test_a_tampered_index_cache_is_rebuilt_with_one_line(corpus, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    a = GPTDataset(IndexedDataset(corpus), (0, 30), 40, 16, 1234, cache)
    expected = [a[i].copy() for i in range(len(a))]
    shuffle = next(os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("shuffle_index.npy"))
    tampered = np.load(shuffle)[::-1].copy()
    np.save(shuffle, tampered)  # a valid .npy, other contents
    capsys.readouterr()
    b = GPTDataset(IndexedDataset(corpus), (0, 30), 40, 16, 1234, cache)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "does not match its checksum: rebuilding it" in lines[0]
    assert all(np.array_equal(b[i], e) for i, e in enumerate(expected))
    c = GPTDataset(IndexedDataset(corpus), (0, 30), 40, 16, 1234, cache)  # rebuilt: used as is now
    assert not capsys.readouterr().out and all(np.array_equal(c[i], e) for i, e in enumerate(expected))


class Payload:
    """Pickled as `exec(code)`: creates the marker file if it is ever unpickled."""

    def __init__(self, marker):
        self.code = f"open({str(marker)!r}, 'w').close()"

    def __reduce__(self):
        return exec, (self.code,)


@pytest.mark.parametrize("planted", ["object_array", "float_array"])
def test_an_index_cache_file_with_a_matching_checksum_but_no_index_array_is_refused(corpus, tmp_path, planted):
    """Its checksum rewritten to match, so it is taken as cached: an object array (a pickle) is
    refused without unpickling it, and one of floats is not misread as an index; one line each,
    naming the file."""
    cache, marker = str(tmp_path / "cache"), tmp_path / "PWNED"
    GPTDataset(IndexedDataset(corpus), (0, 30), 40, 16, 1234, cache)
    shuffle = next(os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("shuffle_index.npy"))
    if planted == "object_array":
        np.save(shuffle, np.array([Payload(marker), None], dtype=object), allow_pickle=True)
    else:
        np.save(shuffle, np.load(shuffle).astype(np.float64))
    with open(f"{shuffle}.crc32", "w") as f:
        f.write(f"{zlib.crc32(open(shuffle, 'rb').read())}\n")
    with pytest.raises(DataError) as e:
        GPTDataset(IndexedDataset(corpus), (0, 30), 40, 16, 1234, cache)
    message = str(e.value)
    assert message.startswith(f"data index cache {shuffle} is not an index array this cache writes (")
    assert "\n" not in message and message.endswith("remove it (and its .crc32) to rebuild it")
    assert ("Python objects" if planted == "object_array" else "its dtype is float64") in message
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"\x00\x01\xff\xfe binary\n", b'{"other": "key"}\n', b'{"text": ""}\n'])
def test_preprocessing_an_input_without_documents_is_refused(tmp_path, content):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    cfg = DataConfig(tokenizer_type="NullTokenizer", vocab_size=1000)
    with pytest.raises(PreprocessError, match="no document with a token.*nothing written"):
        preprocess(str(src), str(tmp_path / "out"), cfg, log=open(os.devnull, "w"))
    assert not list(tmp_path.glob("out*"))
    src.write_text(json.dumps({"text": "1 2 3"}) + "\n")  # one real document is enough
    preprocess(str(src), str(tmp_path / "out"), cfg, log=open(os.devnull, "w"))
    assert IndexedDataset(tmp_path / "out_text_document").num_tokens == 3


def test_preprocessing_onto_an_existing_dataset_is_refused_and_leaves_it(tmp_path):
    """Another corpus's .bin/.idx at the output prefix are never replaced: one line naming the file."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "1 2 3"}) + "\n")
    cfg = DataConfig(tokenizer_type="NullTokenizer", vocab_size=1000)
    preprocess(str(src), str(tmp_path / "out"), cfg, log=open(os.devnull, "w"))
    before = {p.name: p.read_bytes() for p in tmp_path.glob("out*")}
    src.write_text(json.dumps({"text": "4 5"}) + "\n")
    with pytest.raises(PreprocessError, match=r"out_text_document\.bin already exists: .*nothing was written"):
        preprocess(str(src), str(tmp_path / "out"), cfg, log=open(os.devnull, "w"))
    (tmp_path / "out_text_document.bin").unlink()  # the index alone is refused too
    with pytest.raises(PreprocessError, match=r"out_text_document\.idx already exists"):
        preprocess(str(src), str(tmp_path / "out"), cfg, log=open(os.devnull, "w"))
    assert (tmp_path / "out_text_document.idx").read_bytes() == before["out_text_document.idx"]
