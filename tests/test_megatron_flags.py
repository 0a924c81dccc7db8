"""Megatron-LM's flags on train.py's command line (dtgpt/config/megatron_flags.py): the table maps
every key that has a Megatron flag, each flag sets its key, internals are noted, other Megatron
flags refused by name, and Megatron's 175B launch script (shrunk) trains under torchrun."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from dtgpt.cli import run_main
from dtgpt.config import Config, load_config
from dtgpt.config.loading import _unwrap_optional
from dtgpt.config.megatron_flags import CHOICES, IGNORED, RENAMED, flag_table, markdown_table, megatron_flags
from dtgpt.config.megatron_names import NEWER_FLAGS

REPO = Path(__file__).resolve().parent.parent

# Megatron-LM's flag -> the dtgpt key it must set: the flags of Megatron's 175B example and the
# MoE ones, written out by hand from Megatron's arguments.py (megatron-core ships no
# megatron.training, so its parser cannot be imported here; see test_flag_list_is_megatrons).
MEGATRON_EXAMPLE = {
    "--num-layers": "model.num_layers", "--hidden-size": "model.hidden_size",
    "--num-attention-heads": "model.num_attention_heads", "--seq-length": "model.seq_length",
    "--max-position-embeddings": "model.max_position_embeddings", "--micro-batch-size": "training.micro_batch_size",
    "--global-batch-size": "training.global_batch_size", "--rampup-batch-size": "training.rampup_batch_size",
    "--train-iters": "training.train_iters", "--weight-decay": "optimizer.weight_decay",
    "--adam-beta1": "optimizer.adam_beta1", "--adam-beta2": "optimizer.adam_beta2",
    "--init-method-std": "model.init_method_std", "--clip-grad": "optimizer.clip_grad", "--fp16": "training.fp16",
    "--bf16": "training.bf16", "--lr": "optimizer.lr", "--lr-decay-style": "optimizer.lr_decay_style",
    "--min-lr": "optimizer.min_lr", "--lr-warmup-fraction": "optimizer.lr_warmup_fraction",
    "--lr-decay-iters": "optimizer.lr_decay_iters", "--tensor-model-parallel-size": "parallel.tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "parallel.pipeline_model_parallel_size", "--data-path": "data.data_path",
    "--vocab-file": "data.vocab_file", "--merge-file": "data.merge_file", "--split": "data.split",
    "--log-interval": "logging.log_interval", "--save-interval": "checkpoint.save_interval",
    "--eval-interval": "eval.eval_interval", "--save": "checkpoint.save", "--load": "checkpoint.load",
    "--eval-iters": "eval.eval_iters", "--tensorboard-dir": "logging.tensorboard_dir", "--mock-data": "data.mock_data",
    "--tokenizer-type": "data.tokenizer_type", "--vocab-size": "data.vocab_size", "--no-load-optim": "checkpoint.load_optimizer",
    "--norm-epsilon": "model.norm_epsilon", "--disable-bias-linear": "model.add_bias_linear",
    "--no-bias-gelu-fusion": "model.bias_gelu_fusion", "--num-experts": "model.num_experts",
    "--moe-router-topk": "model.moe_router_topk", "--expert-model-parallel-size": "parallel.expert_model_parallel_size",
    "--moe-aux-loss-coeff": "model.moe_aux_loss_coeff", "--moe-grouped-gemm": "model.moe_grouped_gemm",
    "--moe-token-dispatcher-type": "model.moe_token_dispatcher_type", "--moe-enable-deepep": "model.moe_enable_deepep",
    "--moe-flex-dispatcher-backend": "model.moe_flex_dispatcher_backend",
    "--expert-tensor-parallel-size": "parallel.expert_tensor_parallel_size",
    "--moe-router-force-load-balancing": "model.moe_router_force_load_balancing",
}  # fmt: skip
LATER_KEYS = {  # keys of Megatron's training controls, mapped once their config keys exist
    "--train-samples": "training.train_samples", "--step-batch-size-schedule": "training.step_batch_size_schedule",
    "--calculate-per-token-loss": "training.calculate_per_token_loss", "--finetune": "checkpoint.finetune",
    "--no-load-rng": "checkpoint.load_rng", "--override-opt_param-scheduler": "optimizer.override_opt_param_scheduler",
    "--use-checkpoint-opt_param-scheduler": "optimizer.use_checkpoint_opt_param_scheduler",
    "--start-weight-decay": "optimizer.start_weight_decay", "--end-weight-decay": "optimizer.end_weight_decay",
    "--weight-decay-incr-style": "optimizer.weight_decay_incr_style",
    "--init-method-xavier-uniform": "model.init_method_xavier_uniform", "--embedding-init-method-std": "model.embedding_init_method_std",
}  # fmt: skip


def _keys() -> dict[str, typing.Any]:
    return {
        f"{s.name}.{name}": tp
        for s in dataclasses.fields(Config)
        for name, tp in typing.get_type_hints(s.default_factory).items()
        if not name.startswith("_")
    }


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def test_the_example_flags_map_to_their_keys():
    table = {f"--{name}": m.key for name, m in flag_table().items()}
    for flag, key in MEGATRON_EXAMPLE.items():
        assert table.get(flag) == key, flag
    for flag, key in LATER_KEYS.items():
        if key in _keys():  # the controls land on another branch
            assert table.get(flag) == key, flag


def test_flag_list_is_megatrons():
    """The packed flag list was read from Megatron-LM 0.16.1's parser; where Megatron's parser can
    be imported, compare with it."""
    if importlib.util.find_spec("megatron.training") is None:
        flags = megatron_flags()
        assert len(flags) > 600 and flags["rampup-batch-size"].arity == "3" and flags["data-path"].arity == "*"
        assert flags["no-bias-gelu-fusion"].stores is False and flags["norm-epsilon"].dest == "layernorm_epsilon"
        pytest.skip("megatron.training is not installed (megatron-core ships megatron.core only)")
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    theirs = {s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert {name for name in megatron_flags() if name not in NEWER_FLAGS.split()} <= theirs


FORMATTED = {"training.step_batch_size_schedule": "0:4 1K:8", "model.moe_layer_freq": "([0]*3+[1]*58)", "optimizer.optimizer": "sgd",
             "model.window_attn_skip_freq": "[1,1,1,0]*3", "model.no_rope_freq": "([0]*3+[1])*3", "model.softmax_type": "learnable"}
"""Keys whose strings have a format (or choices) checked as they are read: a well-formed value."""


def _value_for(key: str, tp) -> typing.Any:
    """A value unlike any default, for a key of type tp."""
    if key in FORMATTED:
        return FORMATTED[key]
    inner, _ = _unwrap_optional(tp)
    if inner is bool:
        return True
    return {int: 7, float: 0.375, str: "x y", list[str]: ["0.3", "a b", "0.7", "c,d"], list[int]: [2, 4, 8]}[inner]


def test_every_key_with_a_megatron_flag_maps_and_round_trips():
    """Every mapped key: the Megatron spelling of a value sets the key to it, as its own
    --section.key spelling does, and a flag without a value sets what the table says."""
    types = _keys()
    assert {m.key for m in flag_table().values()} <= set(types)
    for name, m in flag_table().items():
        if m.flag.arity == "0":
            argv, expected = [f"--{name}"], m.value
        elif name in CHOICES:  # a value naming a setting: each of Megatron's sets the key (TOML text), or nothing
            for value, text in CHOICES[name][1].items():
                cfg = load_config(None, [f"--{name}", value], check=False)
                default = _get(load_config(None, [], check=False), m.key)
                assert _get(cfg, m.key) == ({"true": True, "false": False}.get(text, text) if text is not None else default), (name, value)
            continue
        else:
            expected = _value_for(m.key, types[m.key])
            values = expected if isinstance(expected, list) else [str(expected)]
            if m.flag.arity == "1" and isinstance(expected, list):  # one value holding the list: Megatron's tuple_type, "128,0"
                values = [",".join(map(str, expected))]
            argv = [f"--{name}", *(str(v) for v in values)]
        cfg = load_config(None, argv, check=False)
        assert _get(cfg, m.key) == expected, (name, _get(cfg, m.key))
        spelled = expected if not isinstance(expected, list) else "[" + ", ".join(repr(v) if isinstance(v, int) else f'"{v}"' for v in expected) + "]"
        again = load_config(None, [f"--{m.key}={str(spelled).lower() if isinstance(spelled, bool) else spelled}"], check=False)
        assert _get(again, m.key) == expected


def test_every_key_named_as_a_megatron_flag_is_in_the_table():
    """A config key named as a Megatron argument (or its dest) gets that flag: the table cannot
    miss one."""
    by_name = {f.name.replace("-", "_") for f in megatron_flags().values()} | {f.dest for f in megatron_flags().values()}
    mapped = {m.key for m in flag_table().values()}
    assert [k for k in _keys() if k.split(".")[1] in by_name and k not in mapped] == []
    assert all(name in megatron_flags() for name in [*RENAMED, *IGNORED])
    assert not set(IGNORED) & set(flag_table())


def test_docs_page_is_current():
    assert (REPO / "docs" / "megatron_flags.md").read_text() == markdown_table()


def _cli(capfd, argv: list[str]) -> tuple[int, str, str]:
    code = run_main(argv, None, None)
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fp8-format", "hybrid"], "error: --fp8-format is a Megatron-LM flag dtgpt does not implement"),
        (["--num-layer", "3"], "error: unexpected argument '--num-layer'; did you mean '--num-layers'?"),
        (["--num-layers", "4", "--model.num_layers=5"], "both set model.num_layers, to 4 and 5; keep one"),
        (["--lr", "1e-3", "--lr", "2e-3"], "error: --lr 1e-3 and --lr 2e-3 both set --lr, to 0.001 and 0.002"),  # in the words typed
        (["--rampup-batch-size", "16", "16"], "error: --rampup-batch-size needs 3 values, got 2"),
        (["--fp16=true"], "--fp16 takes no value"),
        (["--hidden-size"], "error: --hidden-size needs a value"),
        (["--mtp-num-layers", "two"], "error: --mtp-num-layers two must be an int (or unset)"),
    ],
    ids=["unimplemented", "closest", "flag-and-key", "flag-twice", "nargs", "no-value", "missing-value", "mtp-type"],
)
def test_bad_megatron_flags_are_one_error_line(capfd, argv, message):
    for mode in (["--print-config"], []):  # before any process group in either path
        code, out, err = _cli(capfd, [*mode, "--mock-data", *argv])
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert "Traceback" not in err and out == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizer", "sgd", "--sgd-momentum", "1.5"], "error: --sgd-momentum 1.5 must be in [0, 1)"),
        (["--position-embedding-type", "none"],  # Megatron's 'none' (no position embedding), read as the key unset
         "error: --position-embedding-type is unset (none, null or empty); it must be one of: 'learned_absolute', 'rope'"),
        (["--mtp-loss-scaling-factor", "0.5"], "error: --mtp-loss-scaling-factor 0.5 needs --mtp-num-layers"),
        (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "2"],
         "needs --position-embedding-type rope (the last stage shares the word embedding only, not the position embedding)"),
        (["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
         "error: --expert-tensor-parallel-size 2: only 1 is built (each expert is kept whole on every tensor-parallel rank"),
        (["--num-experts", "4", "--moe-enable-deepep"], "error: --moe-enable-deepep needs --moe-token-dispatcher-type flex"),
        (["--num-experts", "4", "--moe-token-dispatcher-type", "flex", "--moe-expert-capacity-factor", "1",
          "--moe-pad-expert-input-to-capacity"], "is not taken with --moe-token-dispatcher-type flex and the DeepEP backend"),
        (["--num-experts", "4", "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep", "--moe-flex-dispatcher-backend",
          "hybridep"], "error: --moe-enable-deepep names the DeepEP backend but --moe-flex-dispatcher-backend hybridep; keep one"),
        (["--num-experts", "4", "--moe-router-force-load-balancing", "--training.compile=true"],
         "is not supported with --moe-router-force-load-balancing"),
        (["--num-experts", "4", "--moe-shared-expert-gate"],
         "error: --moe-shared-expert-gate needs --num-experts and --moe-shared-expert-intermediate-size (got 4 and None)"),
    ],
    ids=["sgd-momentum", "choice-none", "mtp-scale-alone", "mtp-pp-learned", "expert-tp", "deepep-without-flex", "deepep-pad", "deepep-and-hybridep",
         "forced-balance-compiled", "shared-gate-without-shared-expert"],
)
def test_megatron_flags_that_break_a_rule_are_one_error_line(capfd, argv, message):
    """Flags that parse but break a config rule: the line names the flags as typed (--print-config
    prints the config first, by design)."""
    code, out, err = _cli(capfd, ["--mock-data", *argv])
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err, err


SGD_SCRIPT_LINE = "--optimizer sgd --sgd-momentum 0.8 --lr 0.05 --weight-decay 0.1 --clip-grad 1.0 --use-distributed-optimizer"
"""A launch script's optimizer arguments for Megatron's SGD."""


def test_megatron_sgd_flags_set_the_optimizer_keys():
    """--optimizer sgd and --sgd-momentum set optimizer.optimizer and optimizer.sgd_momentum (the
    distributed optimizer is the note's: dtgpt's FSDP shards SGD's momentum as it shards Adam's
    moments); --sgd-momentum alone leaves Adam, whose step never reads it, as in Megatron."""
    from dtgpt.config.megatron_flags import translate

    cfg = load_config(None, ["--mock-data", *shlex.split(SGD_SCRIPT_LINE)])
    o = cfg.optimizer
    assert (o.optimizer, o.sgd_momentum, o.lr, o.weight_decay, o.clip_grad) == ("sgd", 0.8, 0.05, 0.1, 1.0)
    assert translate(shlex.split(SGD_SCRIPT_LINE)).ignored == ["--use-distributed-optimizer"]
    alone = load_config(None, ["--mock-data", "--sgd-momentum", "0.8"]).optimizer
    assert (alone.optimizer, alone.sgd_momentum) == ("adam", 0.8)
    assert load_config(None, ["--mock-data"]).optimizer.sgd_momentum == 0.9  # Megatron's default


MOE_SCRIPT_FLAGS = [  # the MoE flags of Megatron's Mixtral and DeepSeek-V3 (Megatron FSDP) launch scripts
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "flex",
    "--moe-flex-dispatcher-backend", "hybridep", "--expert-tensor-parallel-size", "1", "--moe-permute-fusion",
    "--moe-router-fusion", "--moe-shared-expert-overlap", "--moe-per-layer-logging",
]  # fmt: skip


def test_megatron_moe_script_flags_are_taken():
    """Dispatchers, expert tp 1 and per-layer logging set their keys (checked as Megatron checks
    them); fusions and overlap are accepted with the note."""
    from dtgpt.config.megatron_flags import translate

    cfg = load_config(None, ["--mock-data", *MOE_SCRIPT_FLAGS])
    m = cfg.model
    assert (m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend, m.num_experts) == ("flex", "hybridep", 8)
    assert cfg.parallel.expert_tensor_parallel_size == 1 and m.moe_per_layer_logging
    assert translate(MOE_SCRIPT_FLAGS).ignored == ["--moe-permute-fusion", "--moe-router-fusion", "--moe-shared-expert-overlap"]


def test_megatron_flags_mix_with_config_and_overrides(capfd, tmp_path):
    """A Megatron flag beats the config file, like any command-line setting; agreeing settings
    are fine; --fp16 on the command line replaces the file's bf16."""
    config = tmp_path / "c.toml"
    config.write_text("[model]\nnum_layers = 6\n[training]\nbf16 = true\n[optimizer]\nlr_warmup_iters = 5\n")
    cfg = load_config(config, ["--num-layers", "3", "--fp16", "--lr-warmup-fraction", ".01", "--model.hidden_size=128",
                               "--hidden-size", "128", "--data-path", "0.3", "a", "0.7", "b"], check=False)  # fmt: skip
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.training.fp16, cfg.training.bf16) == (3, 128, True, False)
    assert (cfg.optimizer.lr_warmup_fraction, cfg.optimizer.lr_warmup_iters) == (0.01, 0)
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    code, out, err = _cli(capfd, ["--print-config", "--use-mcore-models", "--transformer-impl", "local", "--mock-data",
                                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "127"])  # fmt: skip
    assert code == 0 and err == ""
    assert out.splitlines()[0] == (
        "# ignoring Megatron-LM flags that choose only Megatron's internals: --use-mcore-models --transformer-impl local"
    )


# -- Megatron's 175B launch script, shrunk -----------------------------------------------------

SHRUNK = {  # flag -> the values of the shrunk copy; None drops the flag
    "--num-layers": ["2"], "--hidden-size": ["64"], "--num-attention-heads": ["4"], "--seq-length": ["32"],
    "--max-position-embeddings": ["32"], "--global-batch-size": ["8"], "--rampup-batch-size": ["4", "4", "8"],
    "--train-iters": ["10"], "--lr-decay-iters": ["10"], "--lr-warmup-fraction": [".1"], "--lr": ["3e-3"],
    "--tensor-model-parallel-size": ["2"], "--pipeline-model-parallel-size": ["1"], "--log-interval": ["5"],
    "--save-interval": ["10"], "--eval-interval": ["10"], "--eval-iters": ["1"],
    "--data-path": None, "--vocab-file": None, "--merge-file": None,
}  # fmt: skip
TINY_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--num-workers", "0"]


def _script_arrays(tmp_path: Path) -> list[str]:
    """train.py's arguments as the launch script builds them (its dry run prints the command)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "DTGPT_DRY_RUN": "1"}
    paths = [str(tmp_path / "ckpt"), str(tmp_path / "tb"), "/vocab.json", "/merges.txt", "0.3 /data/a 0.7 /data/b"]
    proc = subprocess.run(["bash", str(REPO / "scripts" / "train_gpt3_175b_distributed.sh"), *paths], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launch = shlex.split(proc.stdout.strip().splitlines()[-1])
    return launch[launch.index(str(REPO / "train.py")) + 1 :]


def _shrink(args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        if args[i] in SHRUNK:
            out += [] if SHRUNK[args[i]] is None else [args[i], *SHRUNK[args[i]]]
        else:
            out += args[i:j]
        i = j
    return out + TINY_DATA


@pytest.mark.slow
def test_megatron_175b_script_arrays_shrunk_train_under_torchrun(tmp_path):
    """The script's arrays, shrunk to a tiny model on mock data with tp2, train to iteration 10
    on two gloo ranks and save; --print-config shows the mapped keys."""
    args = _script_arrays(tmp_path)
    assert args[:4] == ["--num-layers", "96", "--hidden-size", "12288"] and "--fp16" in args
    assert args[args.index("--data-path") + 1 : args.index("--vocab-file")] == ["0.3", "/data/a", "0.7", "/data/b"]
    shrunk = _shrink(args)
    printed = subprocess.run([sys.executable, str(REPO / "train.py"), "--print-config", *shrunk], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    for line in ["num_layers = 2", "tensor_model_parallel_size = 2", "rampup_batch_size = [4, 4, 8]", "fp16 = true",
                 "lr = 0.003", 'lr_decay_style = "cosine"', 'split = "949,50,1"', "adam_beta2 = 0.95",
                 f'save = "{tmp_path / "ckpt"}"', "mock_data = true", "vocab_size = 127", "init_method_std = 0.006"]:  # fmt: skip
        assert line in printed.stdout.splitlines(), line
    assert printed.stdout.startswith("# ignoring Megatron-LM flags that choose only Megatron's internals: --attention-backend auto")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(REPO / "train.py")]
    proc = subprocess.run(cmd + shrunk, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert log.count("> ignoring Megatron-LM flags that choose only Megatron's internals: --attention-backend auto") == 1
    assert f"iteration {10:8d}/{10:8d}" in log, log[-3000:]  # log_format's line
    assert (tmp_path / "ckpt" / "iter_0000010").is_dir()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"


# -- the vocabulary: Megatron's --make-vocab-size-divisible-by is per tp rank -------------------


@pytest.mark.parametrize(
    "argv, path, multiple",
    [
        (["--tensor-model-parallel-size", "8"], None, 1024),  # Megatron's default, 128 x tp
        (["--tensor-model-parallel-size", "4", "--make-vocab-size-divisible-by", "64"], None, 256),
        (["--make-vocab-size-divisible-by=64", "--parallel.tensor_model_parallel_size=2"], None, 128),
        (["--tensor-model-parallel-size", "8", "--model.make_vocab_size_divisible_by=1024"], None, 1024),  # dtgpt's key
        (["--tensor-model-parallel-size", "8"], "configs/gpt3_175b.toml", 1024),  # the file's multiple, whole
        (["--tensor-model-parallel-size", "2"], "configs/debug.toml", 128),  # a config file's model stays
        (["--parallel.tensor_model_parallel_size=8"], None, 128),  # no Megatron flag: dtgpt's default
    ],
    ids=["default-x-tp", "flag-x-tp", "flag-with-key-tp", "key-wins", "toml-1024", "file", "no-flags"],
)
def test_megatron_vocab_multiple_is_megatrons(argv, path, multiple):
    cfg = load_config(REPO / path if path else None, ["--data.mock_data=true", *argv], check=False)
    assert cfg.model.make_vocab_size_divisible_by == multiple


def test_launch_script_builds_the_175b_config_model(tmp_path):
    """The 175B launch script's flags and configs/gpt3_175b.toml give one model: the same padded
    vocabulary (51,200 rows for GPT-2's 50,257 tokens at tp 8), parameter count and parallel layout."""
    from dtgpt.config import padded_vocabulary
    from dtgpt.model_size import num_parameters

    env = {**os.environ, "PYTHON": sys.executable, "DTGPT_DRY_RUN": "1", "TORCHRUN": "torchrun"}
    script = (REPO / "scripts" / "train_gpt3_175b_distributed.sh").read_text()
    arrays = script[script.index("GPT_MODEL_ARGS=(") : script.index("TRAIN_ARGS=(")]
    args = shlex.split(
        subprocess.run(["bash", "-c", arrays.replace('"${DATA_PATHS[@]}"', "data/x").replace('"$VOCAB_FILE"', "v.json")
                        .replace('"$MERGE_FILE"', "m.txt").replace('"$CHECKPOINT_PATH"', "ck").replace('"$TENSORBOARD_LOGS_PATH"', "tb")
                        + '\nprintf "%q " "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" '
                        '"${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"'], env=env, capture_output=True, text=True, check=True).stdout
    )  # fmt: skip
    from_script = load_config(None, args, check=False)
    from_toml = load_config(REPO / "configs" / "gpt3_175b.toml", check=False)
    assert padded_vocabulary(from_script, 50257) == padded_vocabulary(from_toml, 50257) == 51200
    assert num_parameters(from_script.model, 51200) == num_parameters(from_toml.model, 51200) == 174_615_846_912
    assert from_script.model == from_toml.model or {
        k: (getattr(from_script.model, k), getattr(from_toml.model, k))
        for k in dataclasses.asdict(from_toml.model) if getattr(from_script.model, k) != getattr(from_toml.model, k)
    } == {}
    assert from_script.parallel == from_toml.parallel


def test_launch_script_outside_the_venv_says_torch_is_missing(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "DTGPT_DRY_RUN": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "train_gpt3_175b_distributed.sh"), "ck", "tb", "v", "m", "d"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"error: {python} cannot import torch") and "planner" not in proc.stderr
