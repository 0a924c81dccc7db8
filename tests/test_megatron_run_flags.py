"""Megatron's flags that steer a run (dtgpt/config/megatron_flags.py): the blend read from a file
(--data-args-path, --per-split-data-args-path), --exit-on-missing-checkpoint, --no-save-rng,
--pretrained-checkpoint, --skip-train, --iterations-to-skip and --exit-signal. Each sets its key, a bad value is one error
line before anything starts, and each does what Megatron does on a tiny one-process run.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from dtgpt.api import num_samples_needed, resumed_valid_samples
from dtgpt.checkpoint.checkpoint_args import with_checkpoint_architecture
from dtgpt.cli import run_main
from dtgpt.config import CheckpointConfig, load_config
from dtgpt.config.megatron_flags import translate
from dtgpt.data import build_datasets, build_tokenizer
from dtgpt.faults.signals import ExitConditions
from dtgpt.state import Progress
from tests.runs import read_metrics
from tests.test_data_blended import make_prefix


def test_run_control_flags_set_their_keys():
    cfg = load_config(None, ["--mock-data", "--no-save-rng", "--exit-on-missing-checkpoint", "--skip-train",
                             "--iterations-to-skip", "3", "5", "--exit-signal", "SIGUSR1"])  # fmt: skip
    c = cfg.checkpoint
    assert (c.save_rng, c.exit_on_missing_checkpoint, c.exit_signal) == (False, True, "SIGUSR1")
    assert cfg.eval.skip_train and cfg.training.iterations_to_skip == [3, 5]
    assert not c.load_optimizer  # Megatron turns on --no-load-optim under --skip-train
    defaults = load_config(None, ["--mock-data"])
    assert defaults.checkpoint.save_rng and defaults.checkpoint.load_optimizer and not defaults.eval.skip_train


def test_deprecated_checkpoint_flags_and_logging_extras_are_noted():
    """Megatron itself says --use-dist-ckpt and --dist-ckpt-format have no effect; the logging extras
    change nothing that is trained."""
    flags = ["--use-dist-ckpt", "--dist-ckpt-format", "torch_dist", "--log-memory-interval", "10",
             "--disable-log-loss-scale-to-tensorboard", "--log-world-size-to-tensorboard"]  # fmt: skip
    said = translate(flags)
    assert said.overrides == [] and said.ignored == ["--use-dist-ckpt", "--dist-ckpt-format torch_dist",
                                                     "--log-memory-interval 10", *flags[5:]]  # fmt: skip


def test_data_args_files_become_the_data_keys(tmp_path):
    blend = tmp_path / "blend.txt"
    blend.write_text("0.3 /data/a_text_document\n0.7 /data/b,c_text_document\n")
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": "1 /d/t1 2 /d/t2", "valid": ["/d/v"], "test": ["0.5 /d/x", "0.5 /d/y"]}))
    d = load_config(None, ["--data-args-path", str(blend)], check=False).data
    assert d.data_path == ["0.3", "/data/a_text_document", "0.7", "/data/b,c_text_document"]  # a comma stays in its path
    d = load_config(None, ["--per-split-data-args-path", str(per_split)], check=False).data
    assert d.train_data_path == ["1", "/d/t1", "2", "/d/t2"] and d.valid_data_path == ["/d/v"]
    assert d.test_data_path == ["0.5", "/d/x", "0.5", "/d/y"] and d.data_path == []


def test_a_blend_from_a_file_is_the_data_typed_on_the_command_line(tmp_path):
    """The datasets built from --data-args-path / --per-split-data-args-path are, sample for sample, those of
    --data-path / --train-data-path ... with the file's words."""
    a, b = make_prefix(tmp_path / "a", 0, 500, seed=1), make_prefix(tmp_path / "b", 500, 1000, seed=2)
    (tmp_path / "blend.txt").write_text(f"0.4 {a}\n0.6 {b}\n")
    (tmp_path / "splits.json").write_text(json.dumps({"train": f"0.4 {a} 0.6 {b}", "valid": [b], "test": [a]}))
    base = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seq-length", "16", "--max-position-embeddings", "16",
            "--global-batch-size", "4", "--train-iters", "5", "--eval-iters", "1", "--data-cache-path", str(tmp_path / "cache")]  # fmt: skip
    pairs = [
        (["--data-args-path", str(tmp_path / "blend.txt")], ["--data-path", "0.4", a, "0.6", b]),
        (["--per-split-data-args-path", str(tmp_path / "splits.json")],
         ["--train-data-path", "0.4", a, "0.6", b, "--valid-data-path", b, "--test-data-path", a]),
    ]  # fmt: skip
    for from_file, typed in pairs:
        built = []
        for flags in (from_file, typed):
            cfg = load_config(None, [*base, *flags])
            built.append(build_datasets(cfg, build_tokenizer(cfg.data), num_samples_needed(cfg)))
        assert built[0][0] is not None and len(built[0][0]) >= 20
        for split_from_file, split_typed in zip(*built):  # a split without documents is None in both
            assert (split_from_file is None) == (split_typed is None)
            if split_typed is not None:
                assert len(split_from_file) == len(split_typed)
                assert all(np.array_equal(split_from_file[i], split_typed[i]) for i in range(len(split_typed)))


BAD = [
    (["--data-args-path", "{tmp}/none.txt"], "error: --data-args-path {tmp}/none.txt: no such file"),
    (["--data-args-path", "{tmp}"], "error: --data-args-path {tmp}: cannot be read (Is a directory)"),
    (["--data-args-path", "{tmp}/empty.txt"], "error: --data-args-path {tmp}/empty.txt: the file holds no blend"),
    (["--data-args-path", "{tmp}/odd.txt"], "error: data.data_path=['0.3', 'a', 'b'] (read from --data-args-path {tmp}/odd.txt) must be"),
    (["--per-split-data-args-path", "{tmp}/bad.json"],
     "error: --per-split-data-args-path {tmp}/bad.json: malformed JSON (Expecting ',' delimiter, line 1 column 17); "
     'Megatron reads {{"train": [...], "valid": [...], "test": [...]}}'),
    (["--per-split-data-args-path", "{tmp}/no_test.json"], "error: --per-split-data-args-path {tmp}/no_test.json: no 'test' in it"),
    (["--per-split-data-args-path", "{tmp}/number.json"],
     "error: --per-split-data-args-path {tmp}/number.json: 'valid' is 3; it must be a list of weights and paths"),
    (["--exit-signal", "SIGKILL"], "error: --exit-signal=SIGKILL is not one of Megatron's values: SIGTERM, SIGINT, SIGUSR1, SIGUSR2"),
    (["--checkpoint.exit_signal=HUP"], "error: checkpoint.exit_signal='HUP' is not one of SIGTERM, SIGINT, SIGUSR1, SIGUSR2"),
    (["--iterations-to-skip", "0", "4"], "error: --iterations-to-skip 0 4: iterations count from 1, 0 is none"),
    (["--data-arg-path", "blend.txt"], "error: unexpected argument '--data-arg-path'; did you mean '--data-args-path'?"),
    (["--model-parallel-size", "2"], "error: --model-parallel-size is refused: Megatron-LM refuses it too"),
    (["--full-validation"], "error: --full-validation is refused: dtgpt evaluates --eval-iters global batches"),
]  # fmt: skip


@pytest.mark.parametrize("argv, message", BAD, ids=["missing", "directory", "empty", "blend", "json", "split", "value",
                                                    "signal", "signal-key", "iteration", "typo", "model-parallel", "full-validation"])  # fmt: skip
def test_bad_values_are_one_error_line_before_anything_starts(tmp_path, capfd, argv, message):
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "odd.txt").write_text("0.3 a b")
    (tmp_path / "bad.json").write_text('{"train": ["a"] "valid": []}')
    (tmp_path / "no_test.json").write_text('{"train": ["a"], "valid": ["b"]}')
    (tmp_path / "number.json").write_text('{"train": ["a"], "valid": 3, "test": []}')
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    data = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"] if "data-args-path" in argv[0] else ["--mock-data"]
    for mode in (["--print-config"], []):  # the print path reads the flags too: both before any process group
        assert run_main([*mode, *data, *argv], None, None) == 2
        out, err = capfd.readouterr()
        assert err.count("\n") == 1 and err.startswith(message.format(tmp=tmp_path)) and "Traceback" not in err, err


def test_exit_signal_is_the_one_signal_the_handler_catches():
    """Megatron's --exit-signal SIGUSR1 (Slurm's early warning): SIGUSR1 stops the run after the
    iteration; SIGTERM keeps its own handler (dtgpt's default catches SIGTERM and SIGINT)."""
    term_before = signal.getsignal(signal.SIGTERM)
    exits = ExitConditions(CheckpointConfig(save="ckpt", exit_signal="SIGUSR1"), torch.device("cpu"), announce=False)
    try:
        assert signal.getsignal(signal.SIGTERM) is term_before and exits.reason(1) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert exits.signals.received == signal.SIGUSR1 and exits.reason(2) == "exit signal received"
    finally:
        exits.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_skip_train_evaluates_from_the_first_validation_sample():
    """Megatron's --skip-train asks for one evaluation's validation samples and reads them from 0,
    whatever the checkpoint's consumed_valid_samples."""
    flags = ["--mock-data", "--train-iters", "100", "--eval-interval", "10", "--eval-iters", "2", "--global-batch-size", "8"]
    training, evaluating = load_config(None, flags), load_config(None, [*flags, "--skip-train"])
    assert num_samples_needed(training)[1:] == (11 * 2 * 8, 2 * 8) and num_samples_needed(evaluating)[1:] == (2 * 8, 2 * 8)
    progress = Progress(iteration=60, consumed_valid_samples=96)
    assert resumed_valid_samples(training, progress) == 96 and resumed_valid_samples(evaluating, progress) == 0


TINY = [
    "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
    "--model.hidden_dropout=0.0", "--model.attention_dropout=0.0", "--model.make_vocab_size_divisible_by=64",
    "--training.micro_batch_size=1", "--training.global_batch_size=4", "--training.train_iters=6", "--optimizer.lr=3e-3",
    "--optimizer.lr_warmup_iters=2", "--optimizer.lr_decay_style=cosine", "--data.mock_data=true",
    "--data.tokenizer_type=NullTokenizer", "--data.vocab_size=128", "--data.num_workers=0", "--eval.eval_iters=0",
    "--logging.log_interval=1", "--training.calculate_per_token_loss=true",  # the same loss with or without Megatron's flags
]  # fmt: skip


def _train(capfd, tmp_path, name: str, *args: str) -> tuple[int, str, list[dict]]:
    """An in-process one-process run of train.py's providers: (exit code, its output, its metrics)."""
    import train

    metrics = tmp_path / f"{name}.jsonl"
    code = run_main([*TINY, *args, f"--logging.metrics_file={metrics}"], train.model_provider, train.datasets_provider)
    out, err = capfd.readouterr()
    return code, out + err, read_metrics(metrics) if metrics.exists() else []


@pytest.mark.slow  # eight in-process runs of a 2-layer model (about 3 s of CPU)
def test_run_control_flags_on_a_tiny_run(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, plain = _train(capfd, tmp_path, "plain")
    assert code == 0, out
    # --iterations-to-skip 3: iteration 3's batch is read and counted, nothing else moves
    code, out, left_out = _train(capfd, tmp_path, "left_out", "--iterations-to-skip", "3", "--no-save-rng",
                                 "--save", "ckpt", "--save-interval", "4")  # fmt: skip
    assert code == 0 and "iteration 3: left out (training.iterations_to_skip), its 4 samples consumed" in out, out
    assert [(r["iteration"], r["consumed_samples"]) for r in left_out] == [(1, 4), (2, 8), (4, 16), (5, 20), (6, 24)]
    assert [r["loss"] for r in left_out[:2]] == [r["loss"] for r in plain[:2]]
    assert left_out[2]["lr"] == plain[2]["lr"] and left_out[3]["lr"] == plain[3]["lr"]  # the LR schedule did not step
    assert left_out[2]["loss"] not in (plain[2]["loss"], plain[3]["loss"])  # weights of 2 updates, on batch 4
    # --no-save-rng: the checkpoint holds no generator state, and a resume from it says so
    stored = FileSystemReader(str(tmp_path / "ckpt" / "iter_0000004")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.") for k in stored) and not any(k.startswith("rng.") for k in stored)
    # a resume from iteration 4 reads batch 5 next: the left-out batch was consumed from the stream
    code, out, resumed = _train(capfd, tmp_path, "resumed", "--iterations-to-skip", "3", "--load", "ckpt",
                                "--ckpt-step", "4", "--exit-on-missing-checkpoint")  # fmt: skip
    assert code == 0 and "saved without its generator states (checkpoint.save_rng=false)" in out, out
    assert [(r["iteration"], r["loss"]) for r in resumed] == [(r["iteration"], r["loss"]) for r in left_out[3:]]
    # --pretrained-checkpoint: while the load directory is empty, the run fine-tunes from it as --finetune does
    code, out, finetuned = _train(capfd, tmp_path, "finetuned", "--load", "ckpt", "--finetune", "--training.train_iters=3")
    assert code == 0, out
    start = ["--pretrained-checkpoint", "ckpt", "--load", "tuned", "--save", "tuned", "--training.train_iters=3"]
    code, out, pretrained = _train(capfd, tmp_path, "pretrained", *start)
    assert code == 0 and "loaded checkpoint ckpt/iter_0000006" in out and "checkpoint.finetune: weights only" in out, out
    assert [(r["iteration"], r["loss"]) for r in pretrained] == [(r["iteration"], r["loss"]) for r in finetuned]
    code, out, again = _train(capfd, tmp_path, "again", *start)  # the load directory holds one now: resumed from it
    assert code == 0 and "loaded checkpoint tuned/iter_0000003" in out and again == [], out
    cfg = load_config(None, [*TINY, "--model.num_layers=3", "--pretrained-checkpoint", "ckpt", "--load", "none", "--use-checkpoint-args"])
    assert with_checkpoint_architecture(cfg)[0].model.num_layers == 2  # the architecture comes from it too
    # --skip-train: validation and test of the loaded iteration, no training, no save
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    code, out, records = _train(capfd, tmp_path, "evaluated", "--skip-train", "--load", "ckpt", "--save", "ckpt",
                                "--eval.eval_iters=2", "--training.train_iters=8")  # 2 iterations it does not train  # fmt: skip
    assert code == 0 and records == [] and "saved checkpoint" not in out, out
    assert "> skipping training (eval.skip_train): evaluating iteration 6" in out
    assert "validation loss at iteration 6 |" in out and "validation loss at iteration 6 on test set" in out, out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == saved
    # --exit-on-missing-checkpoint: a save directory with no checkpoint yet is an error, not a fresh start
    code, out, _ = _train(capfd, tmp_path, "missing", "--load", "fresh", "--save", "fresh", "--exit-on-missing-checkpoint")
    assert code == 2 and "error: --load fresh holds no complete checkpoint" in out, out
    assert "--exit-on-missing-checkpoint refuses to start from scratch" in out and "Traceback" not in out
    assert _train(capfd, tmp_path, "fresh", "--load", "fresh2", "--save", "fresh2")[0] == 0  # without it: from scratch
