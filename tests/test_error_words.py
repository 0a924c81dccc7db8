"""Errors in the user's words (dtgpt/config/user_words.py) and said once (dtgpt/error_once.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtgpt.config.megatron_flags import translate
from dtgpt.config.user_words import UserWords
from dtgpt.error_once import first_to_say

REPO = Path(__file__).resolve().parent.parent
RESUME_REFUSAL = (
    "the LR schedule's decay is 30 here (optimizer.lr_decay_iters) but 20 in the checkpoint: set "
    "optimizer.override_opt_param_scheduler=true to follow the config, or "
    "optimizer.use_checkpoint_opt_param_scheduler=true to follow the checkpoint"
)


def words(args: list[str], file_keys=()) -> UserWords:
    return UserWords(translate(args).overrides, set(file_keys))


def test_a_run_launched_with_megatron_flags_is_told_the_flags():
    said = words(["--train-iters", "30", "--lr", "1e-4"]).say(RESUME_REFUSAL)
    assert said == (
        "the LR schedule's decay is 30 here (--lr-decay-iters) but 20 in the checkpoint: set "
        "--override-opt-param-scheduler to follow the config, or "
        "--use-checkpoint-opt-param-scheduler to follow the checkpoint"
    )


def test_the_flag_the_user_typed_names_its_key():
    w = words(["--no-load-optim", "--override-opt_param-scheduler", "--train-iters", "5"])
    assert w.say("checkpoint.load_optimizer=false needs a checkpoint") == "--no-load-optim needs a checkpoint"
    assert w.say("see optimizer.override_opt_param_scheduler.") == "see --override-opt_param-scheduler."
    assert w.say("training.train_iters=5 is below 6") == "--train-iters 5 is below 6"
    assert w.say("training.fp16=True and training.bf16=True") == "--fp16 and --bf16"


def test_keys_the_user_gave_as_keys_stay_keys():
    w = words(["--train-iters", "5", "--training.seed=3"], file_keys={"optimizer.lr"})
    message = "training.seed=3 with optimizer.lr=0.1 in configs/debug.toml; --training.device=cpu runs it"
    assert w.say(message) == message  # typed as keys, or set in the file, or without a flag
    assert words(["--training.train_iters=5"]).say(RESUME_REFUSAL) == RESUME_REFUSAL  # no Megatron flag typed


@pytest.mark.slow
def test_a_config_error_of_a_megatron_launch_names_the_flags():
    proc = subprocess.run(
        [sys.executable, "train.py", "--mock-data", "--fp16", "--bf16"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --fp16 and --bf16 cannot both be set (the command line sets both); keep one"]


def test_one_rank_of_a_launch_says_a_line(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{os.getpid()}-{id(monkeypatch)}")
    assert first_to_say("error one") and not first_to_say("error one")
    assert first_to_say("error two")  # another line is said too
    assert first_to_say("error one", "train.py --config b.toml")  # so is the line of another command
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert first_to_say("error one")  # a restarted group says it again


MEGATRON_RUN = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
    "--save-interval 4 --eval-interval 100"
).split()


@pytest.mark.slow
def test_a_longer_megatron_resume_under_torchrun_is_refused_once_in_megatron_flags(tmp_path):
    """A run launched with Megatron's flags, resumed on 2 ranks with a longer --train-iters: the LR
    schedule's refusal names --override-opt-param-scheduler, once, with no worker traceback."""
    run = [*MEGATRON_RUN, "--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"), "--tensorboard-dir", str(tmp_path / "tb")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run([sys.executable, "train.py", *run, "--train-iters", "4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py", *run, "--train-iters", "8"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, resumed.stderr[-3000:]
    assert "set --override-opt-param-scheduler to follow the config" in errors[0]
    assert "optimizer." not in errors[0]
    assert "Traceback" not in resumed.stderr.split(errors[0])[0]
    assert "exitcode  : 2" in resumed.stderr.split("Root Cause")[1]


def test_a_list_value_is_named_as_the_flag_takes_it():
    """A list key's value is the flag's values (a list's commas once cut the mention short:
    `--data-path ['0.5, 'a', '0.5']`)."""
    w = words(["--data-path", "0.5", "a", "0.5", "--rampup-batch-size", "0", "0", "0"])
    message = "data.data_path=['0.5', 'a', '0.5'] must be prefixes, or weight/prefix pairs like ['0.3', 'a', '0.7', 'b']"
    assert w.say(message) == "--data-path 0.5 a 0.5 must be prefixes, or weight/prefix pairs like ['0.3', 'a', '0.7', 'b']"
    assert w.say("training.rampup_batch_size=[0, 0, 0] needs start > 0") == "--rampup-batch-size 0 0 0 needs start > 0"
