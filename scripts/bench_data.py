#!/usr/bin/env python
"""Benchmark the data pipeline: preprocessing throughput per worker count and sample reads.

    python scripts/bench_data.py            # ~100 MB of JSONL
    python scripts/bench_data.py --mb 20    # smaller
    python scripts/bench_data.py --quick    # ~5 MB, a smoke run
    python scripts/bench_data.py --index-only --index-documents 2000000   # the sample index build alone

Generates a synthetic JSONL corpus (Zipf-distributed pseudo-words, deterministic), tokenizes it
with ByteTokenizer and with a small byte-level BPE trained on its first documents, with 1 and 2
worker processes, then reads GPTDataset samples in training order in one process with a warm
page cache. Prints a table. Then times the sample index build (`build_sample_index`) on a
shuffled epoch of `--index-documents` synthetic documents against megatron-core's C++
`build_sample_idx_int32` when megatron-core is installed (the `dev` extra), checks that both give
the same array, and prints the ratio.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

try:
    import dtgpt  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtgpt.config import DataConfig
from dtgpt.data.gpt_dataset import GPTDataset
from dtgpt.data.gpt_indices import build_sample_index
from dtgpt.data.indexed import IndexedDataset
from dtgpt.data.preprocess import preprocess


def write_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """Documents of 100-800 Zipf-distributed pseudo-words, one JSON object per line."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(5000)]
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    size, target = 0, int(megabytes * 1e6)
    with open(path, "w") as f:
        while size < target:
            ids = rng.choice(len(words), int(rng.integers(100, 800)), p=p)
            line = json.dumps({"text": " ".join([words[i] for i in ids])}) + "\n"
            f.write(line)
            size += len(line)
    return size


def train_bpe(jsonl: str, out_dir: str, vocab_size: int = 4096, docs: int = 2000) -> tuple[str, str]:
    from tokenizers import ByteLevelBPETokenizer

    with open(jsonl) as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, docs)]
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False)
    trainer.save_model(out_dir)
    return os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")


def bench_preprocess(jsonl: str, out: str, cfg: DataConfig, workers: int, repeat: int) -> dict:
    """Best of `repeat` runs by wall time, with the CPU seconds it used (this process + workers)."""
    best = None
    for _ in range(repeat):
        cpu0 = time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        stats = preprocess(jsonl, out, cfg, append_eod=True, workers=workers, log=io.StringIO())
        cpu = time.process_time() + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu0
        for path in stats.outputs:  # preprocess replaces no dataset: the next repeat writes afresh
            for suffix in (".bin", ".idx"):
                os.remove(path + suffix)
        if best is None or stats.seconds < best["wall"]:
            best = {"wall": stats.seconds, "cpu": cpu, "mb": stats.bytes_read / 1e6, "tokens": stats.tokens}
    return best


def bench_reads(prefix: str, seq_length: int, seconds: float, cache_dir: str) -> dict:
    """Samples read in training order (through the shuffle) by one process, page cache warm."""
    indexed = IndexedDataset(prefix)
    num_samples = (indexed.num_tokens - 1) // seq_length
    start = time.perf_counter()
    ds = GPTDataset(indexed, (0, len(indexed)), num_samples, seq_length, 1234, cache_dir)
    build = time.perf_counter() - start
    np.asarray(indexed._bin).sum()  # warm the page cache: the .bin is read once before timing
    for i in range(min(1000, len(ds))):
        ds[i]
    n, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds and n < len(ds):
        for i in range(n, min(n + 1000, len(ds))):
            ds[i]
        n = min(n + 1000, len(ds))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"build": build, "samples": n, "wall": wall, "cpu": cpu, "tokens": n * (seq_length + 1)}


def bench_index_build(documents: int, seq_length: int, repeat: int) -> dict:
    """Least CPU time of `repeat` sample index builds over one shuffled epoch, dtgpt's and (if installed) Megatron's."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1000, documents).astype(np.int32)
    document_index = np.arange(documents, dtype=np.int32)
    np.random.RandomState(1234).shuffle(document_index)
    builds = {"dtgpt": lambda: build_sample_index(sizes, document_index, seq_length)}
    try:
        from megatron.core.datasets.helpers_cpp import build_sample_idx_int32

        tokens = int(sizes.sum(dtype=np.int64))
        builds["megatron"] = lambda: build_sample_idx_int32(sizes, document_index, seq_length, 1, tokens, True, 1)
    except ImportError:
        pass
    best, results = {}, {}
    for _ in range(repeat):
        for name, build in builds.items():  # interleaved, so both see the same machine load
            # CPU time of this process: on a shared machine, waiting for a core does not count.
            start = time.process_time()
            results[name] = build()
            best[name] = min(best.get(name, float("inf")), time.process_time() - start)
    if "megatron" in results and not np.array_equal(results["dtgpt"], results["megatron"]):
        raise AssertionError("dtgpt's sample index differs from Megatron's")
    return best


def main() -> None:
    p = argparse.ArgumentParser(description="data pipeline benchmark")
    p.add_argument("--mb", type=float, default=100.0, help="size of the generated JSONL in MB")
    p.add_argument("--bpe-mb", type=float, default=None, help="size for the BPE runs (default: same as --mb)")
    p.add_argument("--quick", action="store_true", help="a ~5 MB smoke run")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 512])
    p.add_argument("--read-seconds", type=float, default=3.0)
    p.add_argument("--repeat", type=int, default=2, help="runs per preprocessing setting; the fastest counts")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--index-documents", type=int, default=2_000_000, help="documents for the index build timing")
    p.add_argument("--index-repeat", type=int, default=15, help="index builds per side; the fastest counts")
    p.add_argument("--index-only", action="store_true", help="only time the sample index build")
    args = p.parse_args()
    if args.quick:
        args.mb, args.read_seconds, args.repeat = 5.0, 1.0, 1
        args.index_documents, args.index_repeat = 200_000, 3
    if not args.index_only:
        bench_pipeline(args)
    for seq in args.seq_lengths:
        best = bench_index_build(args.index_documents, seq, args.index_repeat)
        line = f"sample index build, {args.index_documents} documents, seq {seq}: dtgpt {best['dtgpt']:.3f} CPU-s"
        if "megatron" in best:
            line += f", Megatron C++ {best['megatron']:.3f} CPU-s, ratio dtgpt/Megatron {best['dtgpt'] / best['megatron']:.2f}"
        print(line)


def bench_pipeline(args: argparse.Namespace) -> None:
    """Preprocessing and read throughput, as a table."""
    bpe_mb = args.bpe_mb or args.mb

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        jsonl = os.path.join(d, "corpus.jsonl")
        start = time.perf_counter()
        size = write_corpus(jsonl, args.mb)
        print(f"generated {size / 1e6:.1f} MB of JSONL in {time.perf_counter() - start:.1f} s ({os.cpu_count()} CPUs)")
        bpe_jsonl = jsonl
        if bpe_mb < args.mb:
            bpe_jsonl = os.path.join(d, "bpe.jsonl")
            write_corpus(bpe_jsonl, bpe_mb)
        vocab, merges = train_bpe(jsonl, d)
        tokenizers = [("ByteTokenizer", jsonl, DataConfig(tokenizer_type="ByteTokenizer")),
                      ("BPE (4096, trained)", bpe_jsonl, DataConfig(vocab_file=vocab, merge_file=merges))]
        rows = []
        for name, src, cfg in tokenizers:
            base = None
            for w in args.workers:
                r = bench_preprocess(src, os.path.join(d, f"out-{w}"), cfg, w, args.repeat)
                base = base or r["wall"]
                rows.append((f"preprocess {name}", f"{w}", f"{r['mb']:.0f} MB", f"{r['wall']:.1f} s",
                             f"{r['mb'] / r['wall']:.1f} MB/s", f"{r['tokens'] / r['wall'] / 1e6:.2f} M tok/s",
                             f"x{base / r['wall']:.2f}", f"{r['cpu']:.1f} s", f"{r['mb'] / r['cpu']:.1f} MB"))
        preprocess(jsonl, os.path.join(d, "out-byte"), tokenizers[0][2], append_eod=True, log=io.StringIO())
        for seq in args.seq_lengths:
            r = bench_reads(os.path.join(d, "out-byte_text_document"), seq, args.read_seconds, os.path.join(d, "cache"))
            rows.append((f"read GPTDataset seq {seq}", "1", f"{r['samples']} samples", f"{r['wall']:.1f} s", "",
                         f"{r['tokens'] / r['wall'] / 1e6:.1f} M tok/s", f"index {r['build']:.1f} s",
                         f"{r['cpu']:.1f} s", f"{r['tokens'] / r['cpu'] / 1e6:.1f} M tok per CPU-s"))
        header = ("what", "procs", "input", "wall", "MB/s", "tokens/s", "speed-up", "CPU", "per CPU-second")
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, tuple("-" * w for w in widths), *rows]:
            print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()
