"""Which evaluations a config leaves data for, through train.py's entry (dtgpt.cli.run_main).

A validation split of weight 0 in data.split, while eval.eval_iters > 0, is one `error:` line
before any process group: Megatron builds no validation set for it and then fails at its first
evaluation with a traceback (pretrain_gpt.py's get_batch calls next() on no iterator). A test
split of weight 0, or per-split paths without data.test_data_path, is a note in the startup
summary: Megatron skips its test evaluation then without a word. Per-split paths without
data.valid_data_path: tests/test_data_blended.py. megatron-core's builder giving no dataset for a
split of weight 0: tests/test_data_megatron_oracle.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from dtgpt.cli import run_main
from dtgpt.data.indexed import IndexedDatasetWriter

TINY = [
    "--model.num_layers=1", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
    "--training.micro_batch_size=2", "--training.global_batch_size=2", "--training.train_iters=1",
    "--data.tokenizer_type=NullTokenizer", "--data.vocab_size=128", "--data.num_workers=0", "--logging.log_interval=1",
    "--eval.eval_interval=1", "--eval.eval_iters=1", "--training.device=cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[str, str, str]:
    """Two prefixes of 40 documents of 20-60 token ids below 100, and a cache directory."""
    d = tmp_path_factory.mktemp("corpora")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        with IndexedDatasetWriter(str(d / name), np.uint16) as writer:
            for _ in range(40):
                writer.add_document(rng.integers(0, 100, rng.integers(20, 60)))
    return str(d / "a"), str(d / "b"), str(d / "cache")


def one_error_line(capfd, argv: list[str]) -> str:
    assert run_main(argv, None, None) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


def train(capfd, argv: list[str]) -> str:
    """train.py's run of argv in this process; its standard output."""
    from train import datasets_provider, model_provider

    assert run_main(argv, model_provider, datasets_provider) == 0
    return capfd.readouterr().out


def test_a_validation_split_of_weight_0_with_evaluation_is_one_error_line(corpora, capfd):
    """In dtgpt's keys and in Megatron's flags; eval.eval_iters=0 trains without evaluation."""
    a, _, cache = corpora
    data = [f"--data.data_path={a}", f"--data.data_cache_path={cache}"]
    assert one_error_line(capfd, [*TINY, *data, "--data.split=100,0,0", "--dry-run"]) == (
        'error: data.split="100,0,0" gives the validation split weight 0, so there is no validation data for '
        'eval.eval_iters=1: give data.split a positive second weight (e.g. "99,1,0"), or set eval.eval_iters=0 '
        "to train without evaluation"
    )
    megatron = ["--data-path", a, "--split", "1", "--eval-iters", "3", "--data-cache-path", cache]
    assert one_error_line(capfd, [*TINY[:-2], *megatron, "--dry-run"]).startswith(
        'error: --split 1 gives the validation split weight 0, so there is no validation data for --eval-iters 3: '
    )
    out = train(capfd, [*TINY, *data, "--data.split=100,0,0", "--eval.eval_iters=0"])
    assert "valid none, test none" in out and "validation loss" not in out


def test_a_test_split_of_weight_0_is_a_note_in_the_startup_summary(corpora, capfd):
    """The run validates and ends without a test evaluation, as Megatron's, and says so once."""
    a, _, cache = corpora
    out = train(capfd, [*TINY, f"--data.data_path={a}", f"--data.data_cache_path={cache}", "--data.split=9,1,0"])
    notes = [line for line in out.splitlines() if line.startswith("> note:")]
    assert notes == ['> note: the test split of data.split="9,1,0" has weight 0: no test evaluation']
    assert "validation loss at iteration 1" in out and "on test set" not in out
    assert "note" not in train(capfd, [*TINY, f"--data.data_path={a}", f"--data.data_cache_path={cache}", "--data.split=8,1,1"])


def test_per_split_paths_without_a_test_path_are_a_note_in_the_startup_summary(corpora, capfd):
    a, b, cache = corpora
    data = [f"--data.train_data_path={a}", f"--data.valid_data_path={b}", f"--data.data_cache_path={cache}"]
    out = train(capfd, [*TINY, *data])
    assert [line for line in out.splitlines() if line.startswith("> note:")] == ["> note: data.test_data_path is unset: no test evaluation"]
    assert "validation loss at iteration 1" in out and "on test set" not in out


def test_a_validation_blend_of_weight_0_is_one_error_line(corpora, capfd):
    """Per-split weights that sum to 0 leave the split nothing to draw from."""
    a, b, cache = corpora
    data = [f"--data.train_data_path={a}", f"--data.data_cache_path={cache}"]
    assert one_error_line(capfd, [*TINY, *data, f"--data.valid_data_path=['0', '{b}']", "--dry-run"]) == (
        f"error: data.valid_data_path=['0', '{b}']: weights must be finite, >= 0, with a positive sum"
    )
