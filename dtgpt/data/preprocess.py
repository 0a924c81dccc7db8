"""JSONL -> indexed datasets `{output_prefix}_{key}_document.bin/.idx`, tokenized in worker processes.

The main process reads the input in chunks of lines, a `multiprocessing.Pool` tokenizes them
(`imap`, so results come back in input order) and the main process appends them to one writer per
JSON key. Bad lines (invalid JSON, a missing key, a non-string value, text the tokenizer rejects)
are reported with their line numbers and skipped, or, with `strict`, refuse the whole file.
Outputs appear under their final names only when the whole input has been processed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, TextIO

import numpy as np

from dtgpt.config import DataConfig
from dtgpt.data.indexed import IndexedDatasetWriter, optimal_dtype
from dtgpt.data.tokenizer import build_tokenizer

MAX_REPORTED_BAD_LINES = 100
"""Bad lines printed one by one; past this only their count is kept (the run goes on)."""


class PreprocessError(ValueError):
    """The input cannot be turned into datasets (missing file, or a bad line under strict)."""


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    bad_lines: int = 0
    empty_documents: int = 0
    first_bad_lines: list[tuple[int, str]] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def summary(self) -> str:
        secs = max(self.seconds, 1e-9)
        return (f"done: {self.documents} documents, {self.tokens} tokens from {self.bytes_read / 1e6:.1f} MB "
                f"in {self.seconds:.1f} s: {self.bytes_read / 1e6 / secs:.2f} MB/s, {self.tokens / secs:,.0f} tokens/s; "
                f"{self.bad_lines} bad lines skipped, {self.empty_documents} empty texts kept as documents without tokens")


def output_prefix(prefix: str, key: str) -> str:
    """Megatron's naming: `{output_prefix}_{key}_document`."""
    return f"{prefix}_{key}_document"


class _Encoder:
    """Turns chunks of JSONL lines into token arrays per key; one per worker process."""

    def __init__(self, tokenizer, json_keys: Sequence[str], append_eod: bool, dtype):
        self.tokenizer = tokenizer
        self.json_keys, self.append_eod, self.dtype = list(json_keys), append_eod, np.dtype(dtype)

    def _texts(self, line: bytes) -> list[str]:
        try:
            obj = json.loads(line)
        except ValueError as e:  # also catches invalid UTF-8
            raise ValueError(f"invalid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"not a JSON object but a {type(obj).__name__}")
        texts = []
        for key in self.json_keys:
            if key not in obj:
                raise ValueError(f"missing key {key!r}")
            if not isinstance(obj[key], str):
                raise ValueError(f"key {key!r} holds a {type(obj[key]).__name__}, not a string")
            texts.append(obj[key])
        return texts

    def encode_chunk(self, chunk: tuple[int, list[bytes]]) -> dict:
        first_line, lines = chunk
        tokens = {k: [] for k in self.json_keys}
        errors, empty = [], 0
        for lineno, line in enumerate(lines, start=first_line):
            if not line.strip():
                continue  # blank lines (often a trailing one) carry no document
            try:
                ids = [self.tokenizer.tokenize(t) for t in self._texts(line)]
            except ValueError as e:
                errors.append((lineno, str(e)))
                continue
            for key, doc in zip(self.json_keys, ids):
                # Megatron's preprocess_data.py: a text with no tokens is still a document, one
                # with no sequences and no eod (so document i is line i).
                if doc and self.append_eod:
                    doc.append(self.tokenizer.eod)
                empty += not doc
                tokens[key].append(np.asarray(doc, dtype=self.dtype))
        out = {"errors": errors, "empty": empty, "bytes": sum(len(line) for line in lines), "keys": {}}
        for key, docs in tokens.items():
            lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
            flat = np.concatenate(docs) if docs else np.zeros(0, self.dtype)
            out["keys"][key] = (flat, lengths)
        return out


# Filled once per worker process by the pool initializer, so the tokenizer is built once per
# worker rather than pickled with every chunk; the main process never touches it.
_worker: dict[str, _Encoder] = {}


def _init_worker(data_cfg: DataConfig, json_keys: Sequence[str], append_eod: bool, dtype) -> None:
    _worker["encoder"] = _Encoder(build_tokenizer(data_cfg), json_keys, append_eod, dtype)


def _encode_in_worker(chunk: tuple[int, list[bytes]]) -> dict:
    return _worker["encoder"].encode_chunk(chunk)


class _ReadAhead:
    """Bounds how many chunks the pool's feeder thread may read ahead of the writer, and lets the
    main process stop it: Pool.terminate() joins that thread, so it must never stay blocked."""

    def __init__(self, slots: int):
        self.slots, self.size, self.stopped = threading.Semaphore(slots), slots, threading.Event()

    def acquire(self) -> bool:
        self.slots.acquire()
        return not self.stopped.is_set()

    def release(self) -> None:
        self.slots.release()

    def stop(self) -> None:
        self.stopped.set()
        self.slots.release(self.size + 1)


def _read_chunks(f, chunk_bytes: int, ahead: Optional[_ReadAhead]) -> Iterator[tuple[int, list[bytes]]]:
    """(first line number, lines) of about chunk_bytes each."""
    lines, size, first = [], 0, 1
    for lineno, line in enumerate(f, start=1):
        lines.append(line)
        size += len(line)
        if size >= chunk_bytes:
            if ahead is not None and not ahead.acquire():
                return
            yield first, lines
            lines, size, first = [], 0, lineno + 1
    if lines and (ahead is None or ahead.acquire()):
        yield first, lines


class _Progress:
    """One stderr line: rewritten in place on a terminal, a new line every few seconds otherwise."""

    def __init__(self, total_bytes: int, log: TextIO):
        self.total, self.log, self.start = max(total_bytes, 1), log, time.perf_counter()
        self.tty = hasattr(log, "isatty") and log.isatty()
        self.last = self.start

    def update(self, stats: PreprocessStats, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        mb, secs = stats.bytes_read / 1e6, max(now - self.start, 1e-9)
        line = (f"[preprocess] {100 * stats.bytes_read / self.total:5.1f}% {mb:.1f}/{self.total / 1e6:.1f} MB, "
                f"{stats.documents} docs, {mb / secs:.2f} MB/s, {stats.tokens / secs:,.0f} tokens/s")
        self.log.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.log.flush()


def preprocess(input_path: str, out_prefix: str, data_cfg: DataConfig, json_keys: Sequence[str] = ("text",),
               append_eod: bool = False, workers: int = 1, strict: bool = False, log: TextIO = sys.stderr,
               chunk_bytes: int = 1 << 20) -> PreprocessStats:
    """Tokenize a JSONL file into one indexed dataset per key; returns counts and throughput.

    workers=1 tokenizes in this process; more start a Pool of that many worker processes.
    """
    if not os.path.isfile(input_path):
        raise PreprocessError(f"{input_path}: " + ("a directory, not a JSONL file" if os.path.isdir(input_path) else "no such input file"))
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    tokenizer = build_tokenizer(data_cfg)
    dtype = optimal_dtype(tokenizer.vocab_size)
    stats = PreprocessStats(outputs=[output_prefix(out_prefix, k) for k in json_keys])
    existing = [p + suffix for p in stats.outputs for suffix in (".bin", ".idx") if os.path.exists(p + suffix)]
    if existing:  # another corpus's dataset, or this one's: replacing it would lose it
        raise PreprocessError(f"{existing[0]} already exists: preprocessing writes new datasets and replaces "
                              "nothing; choose another --output-prefix or remove it (nothing was written)")
    writers = {k: IndexedDatasetWriter(p, dtype) for k, p in zip(json_keys, stats.outputs)}
    progress = _Progress(os.path.getsize(input_path), log)
    start = time.perf_counter()
    pool, ahead = None, None
    try:
        with open(input_path, "rb") as f:
            if workers == 1:
                encoder = _Encoder(tokenizer, json_keys, append_eod, dtype)
                results = map(encoder.encode_chunk, _read_chunks(f, chunk_bytes, None))
            else:
                ahead = _ReadAhead(4 * workers)
                pool = multiprocessing.Pool(workers, _init_worker, (data_cfg, json_keys, append_eod, dtype))
                results = pool.imap(_encode_in_worker, _read_chunks(f, chunk_bytes, ahead))
            for result in results:
                if ahead is not None:
                    ahead.release()
                _absorb(result, writers, stats, input_path, strict, log)
                progress.update(stats)
        stats.seconds = time.perf_counter() - start
        progress.update(stats, final=True)
        if stats.tokens == 0:  # a dataset without a token would fail far later, at training time
            raise PreprocessError(
                f"{input_path}: no document with a token ({stats.documents} documents, {stats.bad_lines} bad lines "
                f"skipped): is it JSONL with the keys {list(json_keys)}? nothing written"
            )
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if pool is not None:
            ahead.stop()
            pool.terminate()
            pool.join()
    for w in writers.values():
        w.finalize()
    return stats


def _absorb(result: dict, writers: dict, stats: PreprocessStats, input_path: str, strict: bool, log: TextIO) -> None:
    """Report a chunk's bad lines (refusing the file under strict) and append its documents."""
    for lineno, message in result["errors"]:
        if stats.bad_lines < MAX_REPORTED_BAD_LINES:
            log.write(f"{input_path}:{lineno}: {message}\n")
            stats.first_bad_lines.append((lineno, message))
        elif stats.bad_lines == MAX_REPORTED_BAD_LINES:
            log.write(f"{input_path}: more than {MAX_REPORTED_BAD_LINES} bad lines; the rest are counted, not shown\n")
        stats.bad_lines += 1
    if result["errors"] and strict:
        first, message = result["errors"][0]
        raise PreprocessError(f"{input_path}:{first}: {message}; strict mode refuses the file, nothing written")
    for key, (flat, lengths) in result["keys"].items():
        writers[key].add_documents(flat, lengths)
    first_key = next(iter(result["keys"]))
    stats.documents += len(result["keys"][first_key][1])
    stats.tokens += sum(len(flat) for flat, _ in result["keys"].values())
    stats.empty_documents += result["empty"]
    stats.bytes_read += result["bytes"]
