"""Megatron's `MMIDIDX` indexed dataset: a `.bin` of raw token arrays and an `.idx` that indexes it.

The `.idx` layout (little-endian), read and written byte for byte:

    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    u64      version (1)
    u8       dtype code (see DTYPE_CODES)
    u64      S, the number of sequences
    u64      D, the number of document indices
    int32[S] sequence lengths (in tokens)
    int64[S] byte offset of each sequence in the `.bin`
    int64[D] document indices: document k is sequences [doc[k], doc[k+1]); starts at 0, ends at S

The `.bin` has no header. Tokens are read through `numpy.memmap`, never loaded whole.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D


class DataError(ValueError):
    """Training data a user must fix (bad files, ids outside the tokenizer); the message names it."""


class IndexedDatasetError(DataError):
    """A `.bin`/`.idx` pair that is not a valid MMIDIDX dataset; the message names the file."""


def _suffix_hint(prefix: str) -> str:
    """A prefix given with its file's suffix (Megatron's --data-path names the pair without one)."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix) and os.path.isfile(prefix):
            return f"; a prefix names the .bin/.idx pair without the suffix: {prefix[: -len(suffix)]}"
    return ""


class DataFileNotFoundError(FileNotFoundError):
    """A data or tokenizer file that does not exist; the message names it."""


class IndexedDatasetNotFoundError(DataFileNotFoundError):
    """A `.bin` or `.idx` file that does not exist; the message names it."""


def optimal_dtype(vocab_size: int) -> type:
    """uint16 while every id fits with room to spare (Megatron's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code; use one of "
                         f"{sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}") from None


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """Read-only view of `{prefix}.bin` + `{prefix}.idx`; validated on open, memory-mapped.

    `ds[i]` is sequence i as a numpy array (a view on the mapped file: copy it before writing);
    `ds.get(i, offset, length)` a slice of it.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self._open()

    # Pickled as its prefix, so DataLoader workers map the files themselves instead of copying them.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def _open(self) -> None:
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        for path in (ipath, bpath):
            if not os.path.isfile(path):
                raise IndexedDatasetNotFoundError(f"{path}: no such file (indexed dataset prefix {self.prefix!r}){_suffix_hint(self.prefix)}")
        idx_size = os.path.getsize(ipath)
        if idx_size < _HEADER.size:
            raise IndexedDatasetError(f"{ipath}: truncated index: {idx_size} bytes, the header alone is {_HEADER.size}")
        with open(ipath, "rb") as f:
            magic, version, code, num_seq, num_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise IndexedDatasetError(f"{ipath}: not an MMIDIDX index: magic bytes {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise IndexedDatasetError(f"{ipath}: unsupported index version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{ipath}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        expected = _HEADER.size + 4 * num_seq + 8 * num_seq + 8 * num_doc
        if idx_size != expected:
            raise IndexedDatasetError(
                f"{ipath}: index is {idx_size} bytes but its header (S={num_seq} sequences, "
                f"D={num_doc} document indices) needs {expected}: truncated or corrupt"
            )
        idx = np.memmap(ipath, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=num_seq, offset=off)
        off += 4 * num_seq
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=num_seq, offset=off)
        off += 8 * num_seq
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=num_doc, offset=off)
        self._idx_map = idx
        self._check_index(ipath, bpath, num_seq)
        # An empty file cannot be memory-mapped; an empty dataset needs no mapping.
        self._bin = np.memmap(bpath, dtype=np.uint8, mode="r") if os.path.getsize(bpath) else np.empty(0, np.uint8)

    def _check_index(self, ipath: str, bpath: str, num_seq: int) -> None:
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != num_seq:
            first = int(docs[0]) if len(docs) else None
            last = int(docs[-1]) if len(docs) else None
            raise IndexedDatasetError(
                f"{ipath}: document indices must start at 0 and end at the sequence count {num_seq}, "
                f"got first={first} last={last}"
            )
        if len(docs) > 1 and np.any(np.diff(docs) < 0):
            raise IndexedDatasetError(f"{ipath}: document indices are not non-decreasing")
        if num_seq == 0:
            return
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        if lengths.min() < 0:
            raise IndexedDatasetError(f"{ipath}: negative sequence length at sequence {int(np.argmin(lengths))}")
        if pointers.min() < 0:
            raise IndexedDatasetError(f"{ipath}: negative byte pointer at sequence {int(np.argmin(pointers))}")
        bin_size = os.path.getsize(bpath)
        ends = pointers + lengths.astype(np.int64) * self.dtype.itemsize
        if ends.max() > bin_size:
            bad = int(np.argmax(ends > bin_size))
            contiguous = np.array_equal(pointers[1:], ends[:-1]) and pointers[0] == 0
            if contiguous:
                raise IndexedDatasetError(
                    f"{bpath}: truncated data file: {bin_size} bytes, but the index {ipath} needs "
                    f"{int(ends[-1])} (sequence {bad} of {num_seq} ends past the end)"
                )
            raise IndexedDatasetError(
                f"{ipath}: sequence {bad} points past the end of {bpath}: bytes "
                f"[{int(pointers[bad])}, {int(ends[bad])}) of a {bin_size}-byte file"
            )
        if ends.max() < bin_size:
            # A reader of the wrong dtype (e.g. int8 over uint16 tokens) sees a data file longer
            # than the sequences it reads: every token it trains on would be misread.
            raise IndexedDatasetError(
                f"{bpath}: {bin_size} bytes, but the sequences of {ipath} end at byte {int(ends.max())} "
                f"(as {self.dtype.name} tokens): a wrong dtype code in the index, or a data file of another index"
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.prefix} with {n} sequences")
        i = int(i) % n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) out of range for sequence {i} of length {size}")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


def check_token_ids(ds: IndexedDataset, vocab_size: int, num_tokens: int = 1 << 20) -> None:
    """DataError when the first `num_tokens` tokens of `ds` hold an id outside [0, vocab_size).

    Cheap by design (a few MB of the `.bin`; all of a large dataset would take minutes): data
    tokenized with another vocabulary shows at once. The samples themselves are checked again
    as they are read (GPTDataset), so a bad id further in is named when it is reached.
    """
    count = min(num_tokens, len(ds._bin) // ds.dtype.itemsize)
    tokens = np.frombuffer(ds._bin, dtype=ds.dtype, count=count)
    bad = np.flatnonzero((tokens >= vocab_size) | (tokens < 0)) if count else []
    if len(bad):
        ids = sorted({int(t) for t in tokens[bad[:1000]]})
        raise DataError(
            f"{bin_path(ds.prefix)}: token ids {ids[:5]}{' ...' if len(ids) > 5 else ''} (first at token {int(bad[0])}; "
            f"{len(bad)} of the first {count} tokens) are outside the tokenizer's vocabulary [0, {vocab_size}): "
            "the data was tokenized with another vocabulary; check data.tokenizer_type, data.vocab_file "
            "and data.vocab_size"
        )


class IndexedDatasetWriter:
    """Writes `{prefix}.bin/.idx` under temporary names; `finalize()` renames them into place.

    Use as a context manager: a clean exit finalizes, an exception removes the temporary files,
    so a reader never sees a half-written dataset under the final name.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._tmp_bin = bin_path(self.prefix) + suffix
        self._tmp_idx = idx_path(self.prefix) + suffix
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = []
        self._num_seq = 0
        self._done = False

    def add_document(self, tokens: Iterable[int] | np.ndarray, sequence_lengths: Optional[list[int]] = None) -> None:
        """One document; by default one sequence, or split into `sequence_lengths` (summing to its length)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        lengths = [len(arr)] if sequence_lengths is None else list(sequence_lengths)
        if sum(lengths) != len(arr):
            raise ValueError(f"sequence_lengths sum to {sum(lengths)} but the document has {len(arr)} tokens")
        self._write(arr, np.asarray(lengths, dtype=np.int64), np.asarray([len(lengths)], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: `tokens` is their concatenation. A document of
        length 0 holds no sequence at all, as Megatron's preprocess_data.py writes an empty text."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        nonempty = lengths > 0
        self._write(np.asarray(tokens, dtype=self.dtype), lengths[nonempty], nonempty.astype(np.int64))

    def _write(self, tokens: np.ndarray, lengths: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        if self._done:
            raise RuntimeError(f"{self.prefix}: writer already finalized")
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2**31-1 tokens does not fit the int32 length field")
        self._bin.write(tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._lengths.append(lengths)
        self._doc_ends.append(self._num_seq + np.cumsum(seqs_per_doc))
        self._num_seq += len(lengths)

    def finalize(self) -> None:
        """Write the index and move both files to their final names (`.bin` first, the `.idx` last)."""
        if self._done:
            return
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        docs = np.concatenate([np.zeros(1, np.int64), *self._doc_ends])
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(lengths), len(docs)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(docs.astype("<i8").tobytes())
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Drop everything written so far; the final names are left untouched."""
        if self._done:
            return
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
