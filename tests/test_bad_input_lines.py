"""Bad input that once ended in a traceback instead of one error line (found by driving train.py
with the mistakes a Megatron user plausibly makes): each is now one `error:` line, exit 2, found
while the config is read, before any process group. In-process: no run starts.
"""

from __future__ import annotations

import pytest

from dtgpt.cli import run_main
from dtgpt.config import ConfigError, load_config

TINY = [
    "--model.num_layers=1", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
    "--training.micro_batch_size=2", "--training.global_batch_size=4", "--training.train_iters=1",
    "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", "--data.vocab_size=128",
]  # fmt: skip


def one_error_line(capfd, argv: list[str]) -> str:
    assert run_main(argv, None, None) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


def test_a_key_above_every_section_is_named_with_its_section(tmp_path, capfd):
    """`num_layers = 4` before any [model] header: the cli's read of the file's keys raised
    TypeError ('int' object is not iterable)."""
    (tmp_path / "top.toml").write_text("num_layers = 4\n[model]\nhidden_size = 32\n")
    (tmp_path / "stray.toml").write_text("nonsense = true\n")
    assert one_error_line(capfd, ["--config", str(tmp_path / "top.toml"), "--dry-run"]) == (
        f"error: {tmp_path / 'top.toml'}: num_layers = 4 is outside any [section]; put it under [model]"
    )
    assert one_error_line(capfd, ["--config", str(tmp_path / "stray.toml")]).endswith(
        "nonsense = True is outside any [section]; no section has a key 'nonsense'"
    )


@pytest.mark.parametrize(
    "key, path, message",
    [
        ("logging.tensorboard_dir", "a_file/tb", "logging.tensorboard_dir=a_file/tb lies under a_file, a file: TensorBoard writes a directory of event files"),
        ("logging.tensorboard_dir", "a_file", "logging.tensorboard_dir=a_file is a file: TensorBoard writes a directory of event files"),
        ("logging.metrics_file", "a_file/m.jsonl", "logging.metrics_file=a_file/m.jsonl lies under a_file, a file: name a file in a directory"),
        ("data.data_cache_path", "a_file", "data.data_cache_path=a_file is a file: the dataset index cache is a directory"),
        ("checkpoint.save", "a_file/x/y", "checkpoint.save=a_file/x/y lies under a_file, a file: checkpoints are a directory of iter_* directories"),
    ],
)  # fmt: skip
def test_an_output_path_under_a_file_is_refused_before_the_run(tmp_path, monkeypatch, key, path, message):
    """These were NotADirectoryError / FileExistsError tracebacks once the run made its folders."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*TINY, f"--{key}={path}"])
    assert str(refused.value) == message
    load_config(None, [*TINY, f"--{key}={tmp_path / 'fresh' / 'place'}"])  # a path yet to be made is fine


def test_a_directory_given_for_a_file_is_called_a_directory(tmp_path):
    """Was 'no such input file' / 'no such file' for a path that exists."""
    from dtgpt.config import DataConfig
    from dtgpt.data.preprocess import PreprocessError, preprocess
    from dtgpt.data.tokenizer import GPT2BPETokenizer

    with pytest.raises(PreprocessError, match=f"^{tmp_path}: a directory, not a JSONL file$"):
        preprocess(str(tmp_path), str(tmp_path / "out"), DataConfig(tokenizer_type="ByteTokenizer"))
    with pytest.raises(FileNotFoundError, match=f"^data.vocab_file='{tmp_path}': a directory, not a file "):
        GPT2BPETokenizer(str(tmp_path), str(tmp_path))


def test_a_data_prefix_given_with_its_suffix_is_told_the_prefix(tmp_path):
    """`--data-path corpus_text_document.bin` (a file the shell completes) named only the missing
    `corpus_text_document.bin.idx`."""
    from dtgpt.data.indexed import IndexedDataset, IndexedDatasetNotFoundError, IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "corpus") as writer:
        writer.add_document([1, 2, 3])
    for suffix in (".bin", ".idx"):
        with pytest.raises(IndexedDatasetNotFoundError, match=f"without the suffix: {tmp_path / 'corpus'}$"):
            IndexedDataset(str(tmp_path / "corpus") + suffix)
    with pytest.raises(IndexedDatasetNotFoundError, match=r"\(indexed dataset prefix '[^']*nothere'\)$"):
        IndexedDataset(str(tmp_path / "nothere"))  # no file of that name: no hint


@pytest.mark.parametrize(
    "override, message",
    [
        ("--optimizer.loss_scale=0", "optimizer.loss_scale=0.0 must be > 0: it is a static fp16 loss scale (unset: dynamic scaling)"),
        ("--optimizer.loss_scale=-1", "optimizer.loss_scale=-1.0 must be > 0: it is a static fp16 loss scale (unset: dynamic scaling)"),
        ("--optimizer.min_loss_scale=-1", "optimizer.min_loss_scale=-1.0 must be > 0"),
    ],
)  # fmt: skip
def test_a_loss_scale_that_is_not_positive_is_refused_before_the_run(override, message):
    """`--fp16 --loss-scale 0` passed the dry run, then the scaler's ValueError was a traceback."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*TINY, "--training.fp16=true", override])
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--data.vocab_size=1"], "data.vocab_size=1 must be >= 2 for NullTokenizer on mock data (the whole vocabulary, the eod its last id)"),
        (["--data.tokenizer_type=GPT2BPETokenizer", "--data.vocab_size=1"], "data.vocab_size=1 must be >= 2 for GPT2BPETokenizer on mock data"),
        (["--data.mock_data=false", "--data.data_path=corpus", "--data.vocab_size=0"], "data.vocab_size=0 must be >= 1 for NullTokenizer"),
    ],
)  # fmt: skip
def test_a_mock_vocabulary_of_the_eod_alone_is_refused_before_the_run(overrides, message):
    """Mock data's vocab_size=1 left the NullTokenizer no id: its ValueError was a traceback."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*TINY, *overrides])
    assert str(refused.value).startswith(message)


def test_a_negative_peak_is_refused_not_taken_for_the_table():
    """logging.peak_tflops=-1 silently meant 0 (look the device up): the MFU the user asked for was not it."""
    with pytest.raises(ConfigError, match=r"^logging.peak_tflops=-1.0 must be >= 0 \(0: the device's own, from a table\)$"):
        load_config(None, [*TINY, "--logging.peak_tflops=-1"])
