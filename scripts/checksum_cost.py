"""What checksumming a checkpoint costs: zlib's CRC-32 throughput on this machine, against a plain
copy of the same bytes in the same run, and the time to save and to load the 175B checkpoint
(configs/gpt3_175b.toml: fp32 weights + AdamW's two moments) at a stated storage bandwidth, with
the checksum's share, as dtgpt does it (each rank its own share, in parallel) and as one rank
reading everything would.

    python scripts/checksum_cost.py [--bandwidth-gbs 1.0] [--ranks 128] [--mib 256]

A save writes each rank's share, then the rank reads it back for its CRC-32 (from the page cache:
CPU-bound); a load reads and checks each item a rank is about to load (from storage, CRC-32 as it
goes), then DCP reads it again (page cache). The bandwidth is per rank (each writes its own files).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dtgpt.config import load_config, padded_vocab_size  # noqa: E402
from dtgpt.model_size import num_parameters  # noqa: E402

BYTES_PER_PARAMETER = 12
"""fp32 weights (the master copy) + exp_avg + exp_avg_sq, as dtgpt saves them."""


def best_rate(fn, data: bytes, repeat: int = 3) -> float:
    """Bytes per CPU second of fn(data), the best of `repeat` runs (CPU time: a shared machine's
    load does not count)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn(data)
        best = min(best, time.process_time() - start)
    return len(data) / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-gbs", type=float, default=1.0, help="storage bandwidth per rank, GB/s")
    parser.add_argument("--ranks", type=int, default=128, help="ranks that save (tp 8 x pp 16 = 128: one dp replica's)")
    parser.add_argument("--mib", type=int, default=256, help="buffer for the throughput measurement")
    args = parser.parse_args(argv)
    data = os.urandom(args.mib << 20)
    crc = best_rate(zlib.crc32, data)
    copy = best_rate(bytearray, data)  # the reference: reading and writing the same bytes once
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/gpt3_175b.toml", [])
    params = num_parameters(cfg.model, padded_vocab_size(cfg.data.vocab_size or 50257, cfg.model.make_vocab_size_divisible_by))
    total = params * BYTES_PER_PARAMETER
    share, disk = total / args.ranks, args.bandwidth_gbs * 1e9
    print(f"CRC-32 (zlib, one core): {crc / 1e9:.2f} GB/s of CPU time; a copy of the same bytes: {copy / 1e9:.2f} GB/s "
          f"(CRC-32 / copy = {crc / copy:.2f})")  # fmt: skip
    print(f"175B checkpoint: {params / 1e9:.1f}B parameters x {BYTES_PER_PARAMETER} B = {total / 1e12:.2f} TB; "
          f"{args.ranks} ranks save {share / 1e9:.1f} GB each at {args.bandwidth_gbs:g} GB/s per rank")  # fmt: skip
    print("| | storage | checksum | total | checksum share |")
    print("|---|---|---|---|---|")
    rows = {
        "save, each rank its share": (share / disk, share / crc),
        "load, each rank its share": (share / disk, share / crc),  # checked as read; DCP's second read hits the page cache
        "rank 0 reads and checksums all": (total / disk, total / crc),
    }
    for name, (io, check) in rows.items():
        print(f"| {name} | {io:.0f} s | {check:.0f} s | {io + check:.0f} s | {check / (io + check):.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
