"""Bad input: train.py prints ONE `error: ...` line and exits 2, with no traceback.

One test per row of README's "Bad input" table, and the read-only checkpoints of docs/faults.md
("What each kind of bad input gets"). The table's runs are independent one-process
`python train.py` invocations; a module fixture starts them all at once (a few at a time) so
the start-up cost of torch is paid in parallel, and each test checks its own result.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dtgpt.checkpoint import layout
from dtgpt.data.indexed import IndexedDatasetWriter
from tests.runs import TRAIN

pytestmark = pytest.mark.slow  # a train.py run per row

TINY = [
    "--model.num_layers=1", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
    "--model.make_vocab_size_divisible_by=64", "--training.micro_batch_size=2", "--training.global_batch_size=4",
    "--training.train_iters=2", "--data.tokenizer_type=NullTokenizer", "--data.vocab_size=128",
    "--data.num_workers=0", "--eval.eval_iters=0", "--logging.log_interval=1",
]  # fmt: skip
MOCK = ["--data.mock_data=true"]
BPE_TEXTS = ["the quick brown fox jumps over the lazy dog", "return the number of items in a container"] * 20


def write_corpus(prefix: Path, high: int = 127, docs: int = 60, length: int = 40) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix) as writer:
        for _ in range(docs):
            writer.add_document(rng.integers(0, high, length))


def bpe_pair(d: Path) -> tuple[Path, Path]:
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(BPE_TEXTS, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(d))
    return d / "vocab.json", d / "merges.txt"


def cases(tmp: Path) -> dict[str, list[str]]:
    """name -> train.py arguments; the files each case needs are written here."""
    (tmp / "malformed.toml").write_text("[model]\nnum_layers = = 2\n")
    (tmp / "wrong_type.toml").write_text('[model]\nhidden_size = "64"\n')
    write_corpus(tmp / "good")
    write_corpus(tmp / "bad_idx")
    with open(tmp / "bad_idx.idx", "r+b") as f:  # the header's sequence count
        f.seek(18)
        f.write((12345).to_bytes(8, "little"))
    write_corpus(tmp / "short_bin")
    os.truncate(tmp / "short_bin.bin", os.path.getsize(tmp / "short_bin.bin") // 2)
    write_corpus(tmp / "wide_ids", high=1000)  # tokenized with a larger vocabulary than 128
    data = ["--data.mock_data=false"]
    out = {
        "malformed_toml": ["--config", str(tmp / "malformed.toml")],
        "unknown_key": TINY + MOCK + ["--model.hiden_size=64"],
        "unknown_section": TINY + MOCK + ["--trainig.train_iters=2"],
        "wrong_type_cli": TINY + MOCK + ["--model.hidden_size=abc"],
        "wrong_type_toml": ["--config", str(tmp / "wrong_type.toml")],
        "impossible_mesh": TINY + MOCK + ["--parallel.tensor_model_parallel_size=2"],
        "missing_data_prefix": TINY + data + [f"--data.data_path={tmp / 'nothere'}", f"--checkpoint.save={tmp / 'new'}"],
        "corrupt_idx": TINY + data + [f"--data.data_path={tmp / 'bad_idx'}"],
        "truncated_bin": TINY + data + [f"--data.data_path={tmp / 'short_bin'}"],
        "ids_outside_vocabulary": TINY + data + [f"--data.data_path={tmp / 'wide_ids'}"],
        "missing_vocab_file": TINY + data + [f"--data.data_path={tmp / 'good'}", "--data.tokenizer_type=GPT2BPETokenizer",
                                             f"--data.vocab_file={tmp / 'nope.json'}", f"--data.merge_file={tmp / 'nope.txt'}"],
        "load_dir_without_checkpoint": TINY + MOCK + [f"--checkpoint.load={tmp / 'empty'}"],
        "metrics_file_is_a_directory": TINY + MOCK + [f"--logging.metrics_file={tmp / 'empty'}"],
        "tensorboard_dir_is_a_file": TINY + MOCK + [f"--logging.tensorboard_dir={tmp / 'malformed.toml'}"],
        "other_model_shape": TINY + MOCK + ["--model.hidden_size=64", f"--checkpoint.load={tmp / 'ckpt'}"],
        "past_train_iters": TINY + MOCK + [f"--checkpoint.load={tmp / 'ckpt'}"],  # not an error: says so
    }  # fmt: skip
    (tmp / "empty").mkdir()
    try:
        vocab, merges = bpe_pair(tmp)
        table = json.loads(vocab.read_text())
        first_merge = merges.read_text().splitlines()[1].split()
        del table["".join(first_merge)]  # merges.txt now makes a token vocab.json lacks
        (tmp / "other_vocab.json").write_text(json.dumps(table))
        out["vocab_merges_mismatch"] = TINY + data + [
            f"--data.data_path={tmp / 'good'}", "--data.tokenizer_type=GPT2BPETokenizer",
            f"--data.vocab_file={tmp / 'other_vocab.json'}", f"--data.merge_file={merges}",
        ]  # fmt: skip
    except ImportError:  # tokenizers is an optional extra
        pass
    return out


def run(tmp: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, TRAIN] + args, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    saved = run(tmp, TINY + MOCK + [f"--checkpoint.save={tmp / 'ckpt'}"])  # for other_model_shape
    assert saved.returncode == 0 and layout.read_pointer(tmp / "ckpt") == 2, saved.stderr[-2000:]
    todo = cases(tmp)
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = dict(zip(todo, pool.map(lambda args: run(tmp, args), todo.values())))
    return tmp, done


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a run, after checking exit status 2 and no traceback."""
    output = proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


def single_error(results, name: str) -> str:
    """The one `error:` line of case `name` (paths relative to the cases' folder)."""
    tmp, done = results
    if name not in done:
        pytest.skip(f"{name}: needs the optional 'tokenizers' library")
    return error_line(done[name]).replace(str(tmp) + "/", "")


def test_malformed_toml_names_line_and_column(results):
    assert "malformed.toml: malformed TOML: Invalid value (at line 2, column 14)" in single_error(results, "malformed_toml")


def test_unknown_key_suggests_the_closest(results):
    assert "unknown key --model.hiden_size; did you mean 'hidden_size'?" in single_error(results, "unknown_key")


def test_unknown_section_suggests_the_closest(results):
    assert "did you mean 'training'?" in single_error(results, "unknown_section")


def test_wrong_type_on_the_command_line(results):
    assert "model.hidden_size='abc' must be an int" in single_error(results, "wrong_type_cli")


def test_wrong_type_in_toml(results):
    assert "model.hidden_size='64' must be an int" in single_error(results, "wrong_type_toml")


def test_impossible_mesh(results):
    assert "world size 1 is not divisible by" in single_error(results, "impossible_mesh")


def test_missing_data_prefix(results):
    assert single_error(results, "missing_data_prefix").startswith("error: nothere.idx: no such file (indexed dataset prefix")
    tmp, _ = results
    assert not (tmp / "new").exists()  # the failed start removed the save directory it created (and its lock)


def test_corrupt_idx(results):
    message = single_error(results, "corrupt_idx")
    assert "bad_idx.idx: index is" in message and "truncated or corrupt" in message


def test_truncated_bin(results):
    assert "short_bin.bin: truncated data file" in single_error(results, "truncated_bin")


def test_token_ids_outside_the_tokenizer_vocabulary(results):
    message = single_error(results, "ids_outside_vocabulary")
    assert "wide_ids.bin: token ids [" in message
    assert "outside the tokenizer's vocabulary [0, 129)" in message and "tokenized with another vocabulary" in message


def test_missing_vocab_file(results):
    message = single_error(results, "missing_vocab_file")
    assert "data.vocab_file=" in message and "nope.json" in message and "no such file" in message
    assert "ByteTokenizer or NullTokenizer needs no files" in message


def test_vocab_and_merges_that_do_not_match(results):
    message = single_error(results, "vocab_merges_mismatch")
    assert "cannot read GPT-2 BPE files" in message and "out of vocabulary" in message


def test_load_dir_without_checkpoint(results):
    message = single_error(results, "load_dir_without_checkpoint")
    assert "checkpoint.load=empty holds no complete checkpoint" in message and "auto_resume" in message


def test_metrics_file_naming_a_directory(results):
    assert "logging.metrics_file=empty is a directory: name a file in it" in single_error(results, "metrics_file_is_a_directory")


def test_tensorboard_dir_naming_a_file(results):
    assert "logging.tensorboard_dir=malformed.toml is a file" in single_error(results, "tensorboard_dir_is_a_file")


def test_checkpoint_of_another_model_shape(results):
    message = single_error(results, "other_model_shape")
    assert "does not fit this model" in message
    # the saved config names the key before any shape is compared
    assert "model.hidden_size: the checkpoint has 32 but the config has 64; set model.hidden_size=32" in message


def test_a_checkpoint_at_train_iters_says_there_is_nothing_to_train(results):
    _, done = results
    proc = done["past_train_iters"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "> nothing to train: the run is at iteration 2 and training.train_iters=2" in proc.stdout


def test_load_equal_to_save_starts_fresh_and_says_so(tmp_path):
    """Not an error: with checkpoint.load == checkpoint.save an empty directory means a first run."""
    ckpt = tmp_path / "ckpt"
    proc = run(tmp_path, TINY + MOCK + [f"--checkpoint.save={ckpt}", f"--checkpoint.load={ckpt}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "holds no complete checkpoint" in proc.stdout and "starting from scratch" in proc.stdout
    assert layout.read_pointer(ckpt) == 2


def test_config_error_under_torchrun_is_one_line_from_one_rank(tmp_path):
    """A malformed blend under torchrun: one `error:` line in all (not one per rank), before any
    process group exists, and no traceback of ours."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", TRAIN,
           *TINY, *MOCK, "--data.mock_data=false", "--data.data_path", "0.3 A 0.7"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and errors == [
        "error: data.data_path=['0.3', 'A', '0.7'] must be prefixes, or weight/prefix pairs like ['0.3', 'a', '0.7', 'b']"
    ], proc.stdout + proc.stderr
    # torchrun prints its own traceback (ChildFailedError) when a worker fails; none of ours
    ours = (f'File "{Path(TRAIN).parent / "dtgpt"}/', f'File "{TRAIN}"')
    assert not any(frame in proc.stdout + proc.stderr for frame in ours), proc.stdout + proc.stderr


@contextlib.contextmanager
def read_only(directory: Path):
    """`directory` read-only for this user: its mode, and for root (whom modes do not stop) the
    immutable attribute; skips where neither stops this user."""
    directory.chmod(0o555)
    immutable = (os.access(directory, os.W_OK) and shutil.which("chattr") is not None
                 and subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0)  # fmt: skip
    try:
        if os.access(directory, os.W_OK):
            pytest.skip("cannot make a directory read-only for this user (root without chattr)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        directory.chmod(0o755)


def test_a_run_that_would_replace_a_read_only_checkpoint_stops_before_training(tmp_path):
    """Resuming from iteration 2 with load == save, or a fresh run with checkpoint.overwrite=true,
    would have to replace iter_0000004, which is read-only: one line before the first iteration
    (not a failed save after training up to it), and nothing there is deleted or replaced."""
    ckpt, run4 = tmp_path / "ckpt", TINY + MOCK + ["--training.train_iters=4", "--checkpoint.save_interval=2"]
    assert run(tmp_path, run4 + [f"--checkpoint.save={ckpt}"]).returncode == 0 and layout.list_iterations(ckpt) == [2, 4]
    files = {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != ".lock"}
    with read_only(layout.iteration_dir(ckpt, 4)):
        for how in ([f"--checkpoint.load={ckpt}", "--checkpoint.load_iteration=2"], ["--checkpoint.overwrite=true"]):
            proc = run(tmp_path, run4 + [f"--checkpoint.save={ckpt}", *how])
            assert error_line(proc) == (
                f"error: checkpoint.save={ckpt}: {ckpt}/iter_0000004 is read-only, and this run would replace it when it "
                "saves iteration 4: make it writable, move it, or save elsewhere (nothing was written)"
            )
            assert "lm loss" not in proc.stdout, proc.stdout  # refused before training
            assert {p: p.read_bytes() for p in files} == files and layout.list_iterations(ckpt) == [2, 4]
            assert not list(ckpt.glob("*.saving")) and layout.read_pointer(ckpt) == 4


def test_a_save_over_a_read_only_checkpoint_leaves_it_and_says_so(tmp_path):
    """A save no check foresaw (a signal's, say) of an iteration whose directory is read-only: the
    old directory stays as it was, the pointer does not move, and the error says why."""
    root = tmp_path / "ckpt"
    final, staging = layout.iteration_dir(root, 4), layout.staging_dir(layout.iteration_dir(root, 4))
    final.mkdir(parents=True)
    (final / "old").write_text("the checkpoint")
    staging.mkdir()
    (staging / "new").write_text("its replacement")
    with read_only(final):
        with pytest.raises(layout.CheckpointError, match=f"^{final} is read-only, so a new save cannot replace it; "):
            layout.swap_in(staging, final)
        assert [p.name for p in final.iterdir()] == ["old"] and (staging / "new").exists()
