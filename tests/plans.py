"""What the planner tests share: the repository, the 175B config, scripts/plan.py's run, and a
small layout where every rank differs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT3_175B = str(REPO / "configs" / "gpt3_175b.toml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# A small layout where every rank differs: uneven pipeline stages, two virtual stages per rank,
# FSDP chunks of unequal size (129 vocabulary rows and 20 positions over dp 2), a tied head.
SMALL = [
    "--model.num_layers=5",
    "--model.hidden_size=24",
    "--model.num_attention_heads=2",
    "--model.seq_length=16",
    "--model.max_position_embeddings=20",
    "--model.make_vocab_size_divisible_by=2",
    "--training.micro_batch_size=1",
    "--training.global_batch_size=8",
    "--parallel.tensor_model_parallel_size=2",
    "--parallel.pipeline_model_parallel_size=2",
    "--parallel.data_parallel_shard_size=2",
    "--parallel.pipeline_schedule=Interleaved1F1B",
    "--parallel.virtual_pipeline_stages_per_rank=2",
    "--parallel.pipeline_layers_per_stage=[2,1,1,1]",
    "--parallel.sequence_parallel=true",
    "--data.builtin_corpus=python-docstrings",
    "--data.tokenizer_type=ByteTokenizer",
]


def run_plan(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / "plan.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
