"""Megatron's --log-progress (`logging.log_progress`): progress.txt in the save directory.

One tab-separated line per event, in Megatron's format, so that its tools (and a reader) find
how far a run of many jobs got and at what throughput:

    2026-01-02 03:04:05<TAB>Job ID: 123<TAB># GPUs: 8<TAB>Starting job
    ...<TAB>Saved checkpoint<TAB>Iteration: 20<TAB>Job throughput: 1.2 TFLOP/s/GPU<TAB>
        Cumulative throughput: 1.1 TFLOP/s/GPU<TAB>Floating-point operations: 3.40e+15<TAB>Tokens (in billions): 0.01
    ...<TAB>Deleted checkpoint<TAB>Iteration: 10

Floating-point operations are the run's so far (dtgpt.model_size.flops_per_token times the
tokens consumed). The job throughput counts this job's; the cumulative one counts from the first
job started at the same number of GPUs (after the last change of it), as Megatron's does. The
job id is the scheduler's (SLURM_JOB_ID), empty elsewhere. Rank 0 writes. An asynchronous save is
logged once it is complete (Megatron's "Saved checkpoint" means the same: committed).
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path

from dtgpt.model_size import flops_per_token

FILE = "progress.txt"
STAMP = "%Y-%m-%d %H:%M:%S"


def _value(token: str) -> str:
    return token.split(": ", 1)[1]


def cumulative_start(path: Path, world_size: int) -> tuple[datetime, float] | None:
    """When the jobs at this GPU count started, and the operations done by then."""
    start, saved_flops = None, 0.0
    for line in path.read_text().splitlines() if path.exists() else []:
        tokens = line.split("\t")
        if len(tokens) < 4:
            continue
        if tokens[3] == "Saved checkpoint" and len(tokens) > 7:
            saved_flops = float(_value(tokens[7]))
        if int(_value(tokens[2])) != world_size:
            start = None
        elif tokens[3] == "Starting job" and start is None:
            start = (datetime.strptime(tokens[0], STAMP), saved_flops)
    return start


class ProgressLog:
    def __init__(self, save_dir: str, world_size: int, flops_per_token: float, seq_length: int):
        self.path = Path(save_dir) / FILE
        self.world_size, self.flops_per_token, self.seq_length = world_size, flops_per_token, seq_length
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self._start_time, self._start_flops = time.time(), 0.0

    def _append(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(f"{datetime.now().strftime(STAMP)}\tJob ID: {self.job_id}\t# GPUs: {self.world_size}\t{text}\n")

    def flops(self, consumed_samples: int) -> float:
        return self.flops_per_token * consumed_samples * self.seq_length

    def start(self, consumed_samples: int) -> None:
        self._start_time, self._start_flops = time.time(), self.flops(consumed_samples)
        self._append("Starting job")

    def saved(self, iteration: int, consumed_samples: int) -> None:
        done = self.flops(consumed_samples)
        tera = 1e12 * self.world_size
        job = (done - self._start_flops) / (max(time.time() - self._start_time, 1e-9) * tera)
        began = cumulative_start(self.path, self.world_size) or (datetime.fromtimestamp(self._start_time), self._start_flops)
        elapsed = max((datetime.now() - began[0]).total_seconds(), 1e-9)
        cumulative = (done - began[1]) / (elapsed * tera)
        tokens = consumed_samples * self.seq_length
        self._append(
            f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\tFloating-point operations: {done:.2e}\t"
            f"Tokens (in billions): {tokens / 10**9:.2f}"
        )

    def deleted(self, iteration: int) -> None:
        self._append(f"Deleted checkpoint\tIteration: {iteration}")


def build_progress_log(cfg, world_size: int, vocab_size: int, consumed_samples: int) -> ProgressLog | None:
    """The started log, when logging.log_progress and checkpoint.save are set (rank 0 calls)."""
    if not (cfg.logging.log_progress and cfg.checkpoint.save):
        return None
    log = ProgressLog(cfg.checkpoint.save, world_size, flops_per_token(cfg.model, vocab_size), cfg.model.seq_length)
    log.start(consumed_samples)
    return log
