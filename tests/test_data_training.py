"""Training on a preprocessed .bin/.idx dataset, as one process and under torchrun.

The same global data order on any mesh (DESIGN invariant 2) shows as identical losses.
"""

import random
import subprocess
import sys

import pytest

from dtgpt.config import ConfigError, load_config
from dtgpt.data.gpt_indices import num_epochs_needed
from dtgpt.data.indexed import IndexedDataset
from tests.runs import REPO, TINY, Command, launch_commands, load_script, read_metrics, run_train, selected_cases

# train.py and torchrun runs; the middle-stage check leaves DataLoader workers behind that torch
# takes ~10 s to shut down (after a worker's error, each join waits out its 5 s timeout)
pytestmark = pytest.mark.slow

BASE = [a for a in TINY if not a.startswith(("--data.mock_data", "--data.vocab_size"))]


def write_corpus(directory, documents: int) -> list[str]:
    """A preprocessed corpus of `documents` runs of integers; returns the data args that read it."""
    rng = random.Random(0)
    lines = []
    for _ in range(documents):
        start = rng.randrange(0, 900)
        doc = " ".join(str(start + (i % 50)) for i in range(rng.randrange(20, 120)))
        lines.append('{"text": "%s"}' % doc)
    (directory / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    subprocess.run(
        [sys.executable, str(REPO / "scripts/preprocess_data.py"), "--input", "corpus.jsonl",
         "--output-prefix", "corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
         "--append-eod", "--workers", "1"],
        cwd=directory, check=True, capture_output=True,
    )  # fmt: skip
    return ["--data.data_path=corpus_text_document", "--data.vocab_size=1000", "--data.data_cache_path=cache"]


def command(key: str, directory, args: list[str], nproc: int = 1) -> Command:
    """A run of BASE + args in directory writing its metrics to KEY.jsonl there."""
    return Command(key, directory, BASE + args + [f"--logging.metrics_file={directory / f'{key}.jsonl'}"], nproc)


def preprocessed_commands(directory) -> list[Command]:
    data = write_corpus(directory, 400) + ["--eval.eval_iters=1", "--eval.eval_interval=5"]
    return [command("single", directory, data), command("dp2", directory, data + ["--parallel.data_parallel_shard_size=2"], 2)]


def resume_commands(directory) -> list[Command]:
    """A 12-iteration run, and a 6-iteration run then its resume to 12 (in this order, in one launch)."""
    data = write_corpus(directory, 40) + ["--data.split=1", "--optimizer.lr_decay_iters=12", "--data.order=stable"]
    six = data + ["--training.train_iters=6", "--checkpoint.save=ckpt", "--checkpoint.save_interval=6"]
    return [command("twelve", directory, data + ["--training.train_iters=12"]), command("six", directory, six),
            command("rest", directory, data + ["--training.train_iters=12", "--checkpoint.load=ckpt"])]  # fmt: skip


def hf_data(directory) -> list[str]:
    """A corpus preprocessed with a HuggingFaceTokenizer written into directory; the args that read it."""
    from tests.test_data_tokenizer import TEXTS, write_hf_tokenizer

    tokenizer = write_hf_tokenizer(directory / "tok")
    (directory / "corpus.jsonl").write_text("".join('{"text": "%d %s"}\n' % (i, t) for i, t in enumerate(TEXTS)))
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]
    subprocess.run([sys.executable, str(REPO / "scripts/preprocess_data.py"), "--input", "corpus.jsonl",
                    "--output-prefix", "corpus", *hf, "--append-eod"], cwd=directory, check=True, capture_output=True)  # fmt: skip
    return ["--data.data_path=corpus_text_document", "--data.split=1", "--data.tokenizer_type=HuggingFaceTokenizer",
            f"--data.tokenizer_model={tokenizer}", "--training.train_iters=4", "--optimizer.lr_warmup_iters=1"]  # fmt: skip


def megatron_tokenizer_data(directory, kind: str) -> list[str]:
    """A corpus preprocessed with Llama2Tokenizer or TikTokenizer (a model trained into directory,
    Megatron's flags); the args that train on it with the same tokenizer."""
    from tests.test_data_tokenizer import TEXTS
    from tests.tokenizer_files import write_sentencepiece_model, write_tiktoken_vocab

    tik = kind == "TikTokenizer"
    model = write_tiktoken_vocab(directory / "tok") if tik else write_sentencepiece_model(directory / "tok")
    (directory / "corpus.jsonl").write_text("".join('{"text": "%d %s"}\n' % (i, t) for i, t in enumerate(TEXTS)))
    flags = ["--tokenizer-type", kind, "--tokenizer-model", str(model)] + (["--vocab-size", "290", "--tiktoken-num-special-tokens", "10"] if tik else [])
    argv = ["--input", str(directory / "corpus.jsonl"), "--output-prefix", str(directory / "corpus"), *flags, "--append-eod"]
    assert load_script("preprocess_data").main(argv) == 0
    keys = [f"--data.tokenizer_type={kind}", f"--data.tokenizer_model={model}"]  # BASE names the key: the same spelling
    keys += ["--data.vocab_size=290", "--data.tiktoken_num_special_tokens=10"] if tik else []
    return [*keys, "--data.data_path=corpus_text_document", "--data.split=1", "--training.train_iters=4",
            "--optimizer.lr_warmup_iters=1", "--data.reset_position_ids=true", "--data.eod_mask_loss=true"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """The selected tests' train.py runs, launched together: one launch per rank count
    (tests/runs.py launch_commands) instead of one each. {key: (Finished, its Command)}."""
    plans = {
        test_train_on_preprocessed_data_single_and_dp2: preprocessed_commands,
        test_raising_train_iters_on_resume_continues_the_same_tokens: resume_commands,
        test_train_on_hugging_face_tokenized_data: lambda d: [command("hf", d, hf_data(d))],
        test_train_on_sentencepiece_and_tiktoken_data: lambda d: [
            command(kind, d / kind, megatron_tokenizer_data(d / kind, kind)) for kind in ("Llama2Tokenizer", "TikTokenizer")],
    }
    commands = [c for test, plan in plans.items() if selected_cases(request, test) for c in plan(tmp_path_factory.mktemp(test.__name__))]
    finished = launch_commands(commands) if commands else {}
    return {c.key: (finished[c.key], c) for c in commands}


def losses_of(runs: dict, key: str) -> list[float]:
    """A batched run's per-iteration losses; a run that failed fails the test with its log."""
    finished, command = runs[key]
    finished.checked()
    return [r["loss"] for r in read_metrics(command.directory / f"{key}.jsonl")]


def args_of(runs: dict, key: str) -> list[str]:
    """A batched run's train.py arguments less its metrics file (command's last): BASE + its data."""
    return runs[key][1].argv[:-1]


def test_train_on_preprocessed_data_single_and_dp2(runs):
    """A 400-document corpus with the default split, which leaves the test split no documents
    ([400, 400)): one note line, no test evaluation, exit 0, and dp2 trains as one process. A train
    split without documents is one error line naming the split and the document count; a train
    weight of 0 is a config error."""
    single, dp2 = losses_of(runs, "single"), losses_of(runs, "dp2")
    tmp_path, args = runs["single"][1].directory, args_of(runs, "single")
    assert list((tmp_path / "cache").rglob("*.npy")), "the index cache was not built: the corpus was not read"
    assert single[-1] < single[0]
    assert dp2 == pytest.approx(single, rel=1e-5)
    log = runs["single"][0].output
    split = load_config(None, args).data.split
    notes = [line for line in log.splitlines() if line.startswith("> note:")]
    assert notes == [f'> note: the test split of data.split="{split}" has no documents of 400: no test evaluation']
    assert "validation loss at iteration 5 |" in log and "on test set" not in log and "Traceback" not in log

    empty_train = run_train(tmp_path, args + ["--data.split=1,999,0"], name="empty_train", check=False)
    assert empty_train.returncode == 2 and "Traceback" not in empty_train.stderr
    assert empty_train.stderr.strip().splitlines() == [
        'error: the train split of data.split="1,999,0" has no documents of 400: nothing to train on; '
        "use more data or a larger train weight"
    ]
    with pytest.raises(ConfigError, match=r'data.split="0,1,0" gives the train split weight 0: training.train_iters=10 needs'):
        load_config(None, args + ["--data.split=0,1,0"])


def test_raising_train_iters_on_resume_continues_the_same_tokens(runs):
    """A run stopped at iteration 6 and resumed with train_iters raised from 6 to 12 reads exactly
    the samples of a 12-iteration run under data.order = "stable": the order does not depend on
    how many samples are asked for, although the longer run needs a second epoch of this
    ~40-document corpus."""
    twelve, first, rest = (losses_of(runs, key) for key in ("twelve", "six", "rest"))
    tmp_path = runs["twelve"][1].directory
    assert len(twelve) == 12 and len(first) == 6 and len(rest) == 6
    assert first + rest == twelve
    tokens = int(IndexedDataset(str(tmp_path / "corpus_text_document")).sequence_lengths.sum())
    assert [num_epochs_needed(tokens, 8 * iters, 32) for iters in (6, 12)] == [1, 2]


class Unreadable:
    """A dataset whose samples must never be read (it counts how often it was asked)."""

    def __init__(self):
        self.reads = 0

    def __len__(self):
        return 1000

    def __getitem__(self, index):
        self.reads += 1
        raise AssertionError("a middle pipeline stage read a sample")


def test_middle_pipeline_stages_read_no_batches():
    """Only the first stage needs tokens and the last labels: a rank holding neither builds the
    datasets (their caches are built collectively) but reads nothing and starts no workers."""
    import torch

    from dtgpt.api import build_data_iterators, init_distributed
    from dtgpt.config import load_config
    from dtgpt.data.batch import TokenOptions
    from dtgpt.parallel import ModelParts

    cfg = load_config(None, TINY + ["--data.num_workers=2", "--eval.eval_iters=1"])
    runtime = init_distributed(cfg)
    datasets = (Unreadable(), Unreadable(), Unreadable())
    options = TokenOptions.from_config(cfg.data, eod=cfg.data.vocab_size - 1)
    # This rank's stages: the middle one of three (no weights needed to say what it reads).
    middle = ModelParts([], [1], 3, runtime.dims, torch.device("cpu"), None, None, False, None)
    iterators = build_data_iterators(cfg, middle, datasets, options)
    assert [next(it) for it in iterators for _ in range(3)] == [None] * 9
    assert [d.reads for d in datasets] == [0, 0, 0]
    train_iter, _, _ = build_data_iterators(cfg, runtime.dims, datasets, options)
    with pytest.raises(Exception, match="a middle pipeline stage read a sample"):
        next(train_iter)


def test_train_on_sentencepiece_and_tiktoken_data(runs):
    """Corpora preprocessed with Megatron's Llama2Tokenizer and TikTokenizer flags train with the same
    flags on train.py: the tokenizer's vocabulary is the model's (padded), its eod ends documents."""
    for kind, ids in (("Llama2Tokenizer", 400), ("TikTokenizer", 290)):
        losses = losses_of(runs, kind)
        assert len(losses) == 4 and all(loss == loss for loss in losses) and losses[-1] < losses[0], kind
        log = runs[kind][0].output
        assert f"{kind} ({ids} ids)" in log and "Traceback" not in log, log[-2000:]


def test_train_on_hugging_face_tokenized_data(runs):
    """A corpus preprocessed with HuggingFaceTokenizer trains with the same tokenizer named in
    [data]: its 321 tokens are the vocabulary (padded to 384), and the ids fit. A missing
    tokenizer directory is one error line at start-up."""
    losses = losses_of(runs, "hf")
    tmp_path, args = runs["hf"][1].directory, args_of(runs, "hf")
    assert len(losses) == 4 and all(loss == loss for loss in losses) and losses[-1] < losses[0]
    log = runs["hf"][0].output
    assert "HuggingFaceTokenizer (321 ids)" in log and "Traceback" not in log
    missing = run_train(tmp_path, args + ["--data.tokenizer_model=missing"], name="missing", check=False)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "error: data.tokenizer_model='missing': no such directory (HuggingFaceTokenizer reads the tokenizer.json "
        "and tokenizer_config.json that Hugging Face saves; dtgpt downloads nothing)"
    ]
