"""MMIDIDX reader/writer: byte-exact format, round trips, and clear errors on corrupt input."""

import os
import struct

import numpy as np
import pytest

from dtgpt.data.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    optimal_dtype,
)

SPEC_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def expected_idx_bytes(code, lengths, doc_indices, itemsize):
    """The .idx exactly as the format spec lays it out, built independently of the writer."""
    pointers = np.concatenate([[0], np.cumsum(np.asarray(lengths[:-1], dtype=np.int64) * itemsize)]) if lengths else []
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
    out += struct.pack(f"<{len(lengths)}i", *lengths)
    out += struct.pack(f"<{len(lengths)}q", *[int(p) for p in pointers])
    out += struct.pack(f"<{len(doc_indices)}q", *doc_indices)
    return out


def test_dtype_codes_match_the_spec():
    assert {c: np.dtype(t) for c, t in DTYPE_CODES.items()} == {c: np.dtype(t) for c, t in SPEC_CODES.items()}
    assert optimal_dtype(50257) is np.uint16 and optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32 and optimal_dtype(128256) is np.int32


@pytest.mark.parametrize("code", sorted(SPEC_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(SPEC_CODES[code])
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, n).astype(dtype) for n in (5, 0, 17, 1)]
    if dtype.kind == "f":
        docs = [d + np.asarray(0.25, dtype) for d in docs]
    prefix = tmp_path / "rt"
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
        w.add_document(np.arange(6, dtype=dtype), sequence_lengths=[2, 4])
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype
    assert len(ds) == 6 and ds.num_documents == 5
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds[4], [0, 1])
    np.testing.assert_array_equal(ds[5], [2, 3, 4, 5])
    np.testing.assert_array_equal(ds.document_indices, [0, 1, 2, 3, 4, 6])
    np.testing.assert_array_equal(ds.sequence_lengths, [5, 0, 17, 1, 2, 4])
    np.testing.assert_array_equal(ds.get(2, 3, 4), docs[2][3:7])
    assert os.path.getsize(f"{prefix}.bin") == (23 + 6) * dtype.itemsize
    assert os.path.getsize(f"{prefix}.idx") == 34 + 12 * 6 + 8 * 6


def test_idx_bytes_follow_the_spec(tmp_path):
    prefix = tmp_path / "spec"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3])
        w.add_document([65535, 0])
        w.add_document([7, 8, 9, 10], sequence_lengths=[1, 3])
    idx = (tmp_path / "spec.idx").read_bytes()
    assert idx == expected_idx_bytes(8, [3, 2, 1, 3], [0, 1, 2, 4], itemsize=2)
    assert (tmp_path / "spec.bin").read_bytes() == struct.pack("<9H", 1, 2, 3, 65535, 0, 7, 8, 9, 10)


def test_reads_a_hand_built_dataset(tmp_path):
    (tmp_path / "hand.idx").write_bytes(expected_idx_bytes(4, [2, 3], [0, 2], itemsize=4))
    (tmp_path / "hand.bin").write_bytes(struct.pack("<5i", -1, 2, 300000, 4, 5))
    ds = IndexedDataset(tmp_path / "hand")
    assert ds.dtype == np.int32 and len(ds) == 2 and ds.num_documents == 1
    np.testing.assert_array_equal(ds[0], [-1, 2])
    np.testing.assert_array_equal(ds[1], [300000, 4, 5])
    np.testing.assert_array_equal(ds.sequence_pointers, [0, 8])


def test_empty_dataset(tmp_path):
    with IndexedDatasetWriter(tmp_path / "empty", np.uint16):
        pass
    ds = IndexedDataset(tmp_path / "empty")
    assert len(ds) == 0 and list(ds.document_indices) == [0]


def test_writer_publishes_only_when_complete(tmp_path):
    prefix = tmp_path / "partial"
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_document([1, 2])
    assert not (tmp_path / "partial.bin").exists() and not (tmp_path / "partial.idx").exists()
    w.finalize()
    assert (tmp_path / "partial.idx").exists()
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "failed", np.uint16) as w2:
            w2.add_document([1])
            raise RuntimeError("tokenizer crashed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["partial.bin", "partial.idx"]


def test_get_bounds(tmp_path):
    with IndexedDatasetWriter(tmp_path / "b", np.uint8) as w:
        w.add_document([1, 2, 3])
    ds = IndexedDataset(tmp_path / "b")
    with pytest.raises(IndexError):
        ds.get(0, 2, 2)
    with pytest.raises(IndexError):
        ds[1]


# ---- corrupt inputs -------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    prefix = tmp_path / "good"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3])
        w.add_document([4, 5])
    return prefix


def patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_wrong_magic(good):
    patch(good.with_suffix(".idx"), 0, b"NOTANIDX!")
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: not an MMIDIDX index: magic"):
        IndexedDataset(good)


def test_wrong_version(good):
    patch(good.with_suffix(".idx"), 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: unsupported index version 2"):
        IndexedDataset(good)


def test_unknown_dtype_code(good):
    patch(good.with_suffix(".idx"), 17, struct.pack("<B", 9))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: unknown dtype code 9"):
        IndexedDataset(good)


def test_truncated_idx(good):
    idx = good.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-3])
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: index is \d+ bytes .* truncated"):
        IndexedDataset(good)
    idx.write_bytes(b"MMIDIDX")
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: truncated index: 7 bytes"):
        IndexedDataset(good)


def test_truncated_bin(good):
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-2])
    with pytest.raises(IndexedDatasetError, match=r"good\.bin: truncated data file: 8 bytes, but the index .* needs 10"):
        IndexedDataset(good)


def test_pointer_past_end(good):
    # sequence 1's pointer (int64 after the 2 int32 lengths) moved past the 10-byte .bin
    patch(good.with_suffix(".idx"), 34 + 8 + 8, struct.pack("<q", 1000))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: sequence 1 points past the end of .*good\.bin"):
        IndexedDataset(good)


def test_document_index_not_ending_at_sequence_count(good):
    # the last document index (after lengths and pointers) says 1 instead of S=2
    patch(good.with_suffix(".idx"), 34 + 8 + 16 + 16, struct.pack("<q", 1))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: document indices must start at 0 and end at the sequence count 2"):
        IndexedDataset(good)


def test_missing_files(good):
    os.remove(good.with_suffix(".bin"))
    with pytest.raises(FileNotFoundError, match=r"good\.bin: no such file"):
        IndexedDataset(good)
    os.remove(good.with_suffix(".idx"))
    with pytest.raises(FileNotFoundError, match=r"good\.idx: no such file"):
        IndexedDataset(good)
