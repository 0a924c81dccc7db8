"""Training on a preprocessed .bin/.idx dataset, as one process and under torchrun.

The same global data order on any mesh (DESIGN invariant 2) shows as identical losses.
"""

import random
import subprocess
import sys

import pytest

from tests.runs import REPO, TINY, train_losses


def test_train_on_preprocessed_data_single_and_dp2(tmp_path):
    rng = random.Random(0)
    lines = []
    for _ in range(300):
        start = rng.randrange(0, 900)
        doc = " ".join(str(start + (i % 50)) for i in range(rng.randrange(20, 120)))
        lines.append('{"text": "%s"}' % doc)
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    subprocess.run(
        [sys.executable, str(REPO / "scripts/preprocess_data.py"), "--input", "corpus.jsonl",
         "--output-prefix", "corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
         "--append-eod", "--workers", "1"],
        cwd=tmp_path, check=True, capture_output=True,
    )  # fmt: skip
    base = [a for a in TINY if not a.startswith(("--data.mock_data", "--data.vocab_size"))]
    data = [
        "--data.data_path=corpus_text_document",
        "--data.vocab_size=1000",
        "--data.split=90,10,0",
        "--data.data_cache_path=cache",
        "--eval.eval_iters=1",
        "--eval.eval_interval=5",
    ]
    single = train_losses(tmp_path, data, name="single", base=base)
    dp2 = train_losses(tmp_path, data + ["--parallel.data_parallel_shard_size=2"], nproc=2, name="dp2", base=base)
    assert list((tmp_path / "cache").rglob("*.npy")), "the index cache was not built: the corpus was not read"
    assert single[-1] < single[0]
    assert dp2 == pytest.approx(single, rel=1e-5)
    assert "validation loss at iteration 5" in (tmp_path / "single.log").read_text()
