"""Megatron's own example launch scripts on train.py: each one's full flag set (Megatron-LM's
Llama-3 8B and Mixtral 8x7B examples, Megatron-MoE-ModelZoo's Qwen3-30B-A3B, DeepSeek-V2-Lite and
DeepSeek-V3 benchmark flag sets; GPT-3 175B is tests/test_megatron_flags.py's), written out below
as flags and values with the scripts' shell variables given small values and the model shrunk,
goes through `train.py --dry-run`; every key a flag sets holds what the flag says (derived from
the flag's values, as Megatron reads them), and the meanings Megatron gives a whole launch script
hold (its NaN check, its vocabulary padding, rotary positions). One dense and one MoE script train
two iterations on mock data in one process."""

from __future__ import annotations

import dataclasses
import logging
import os
import typing

import pytest

from dtgpt.cli import run_main
from dtgpt.config import Config, load_config, padded_vocabulary
from dtgpt.config.loading import _unwrap_optional
from dtgpt.config.megatron_flags import CHOICES, IGNORED, flag_table
from tests.tokenizer_files import write_sentencepiece_model


TINY_DATA = [("--mock-data", []), ("--tokenizer-type", ["NullTokenizer"]), ("--vocab-size", ["127"]), ("--num-workers", ["0"])]
"""Each script's tokenizer and data (a tokenizer model or data path) replaced by mock data (Mixtral's keeps its
Llama2Tokenizer, a SentencePiece model trained in the test, over mock data)."""


def _f(text: str) -> list[tuple[str, list[str]]]:
    """'--a 1 --b --c x y' -> [('--a', ['1']), ('--b', []), ('--c', ['x', 'y'])]."""
    out: list[tuple[str, list[str]]] = []
    for token in text.split():
        if token.startswith("--"):
            out.append((token, []))
        else:
            out[-1][1].append(token)
    return out


# Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh, DTYPE=bf16 (dtgpt has no fp8), mock data
# (the script's own NullTokenizer branch, vocabulary shrunk), 32 -> 2 layers, 4096 -> 64 hidden.
LLAMA3_8B = _f(
    "--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32 "
    "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused "
    "--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear "
    "--micro-batch-size 1 --global-batch-size 4 --train-samples 8 --lr-decay-samples 6 --lr-warmup-samples 2 "
    "--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine "
    "--clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 "
    "--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
    "--exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 127 --tiktoken-pattern v2 --split 99,1,0 "
    "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 0 "
    "--log-interval 1 --eval-iters 1 --eval-interval 100 --save-interval 1000 --log-throughput --profile "
    "--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 "
    "--save CKPT --load CKPT --tensorboard-dir TB"
)

# Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh with WANDB_API_KEY set, its own tokenizer flags
# (a SentencePiece model trained in the test) over mock data: 32 -> 4 layers (pp 4), 4096 -> 64 hidden, ep 8 -> 2.
MIXTRAL_8X7B = _f(
    "--use-mcore-models --disable-bias-linear --seq-length 32 --max-position-embeddings 256 --num-layers 4 "
    "--hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --init-method-std 0.01 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion "
    "--no-position-embedding --rotary-base 1000000 "
    "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce "
    "--split 99990,8,2 --micro-batch-size 1 --global-batch-size 16 --lr 1e-4 --train-iters 10 --lr-decay-iters 8 "
    "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 2 --clip-grad 1.0 --bf16 "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 2 "
    "--use-distributed-optimizer --sequence-parallel --log-interval 1 --save-interval 10000 --eval-interval 1000 "
    "--eval-iters 10 --save CKPT --load CKPT --tensorboard-dir TB --no-load-optim --no-load-rng "
    "--wandb-project Mixtral --wandb-exp-name Mixtral_8x7B "
    "--tokenizer-type Llama2Tokenizer --tokenizer-model TOKENIZER_MODEL --mock-data --num-workers 0"
)

# Megatron-MoE-ModelZoo's Qwen3-30B-A3B model arguments, mock data: 48 -> 2 layers, 128 -> 8 experts;
# the ModelZoo runner's batch, length and logging flags given small values.
QWEN3_30B_A3B = _f(
    "--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear "
    "--untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm "
    "--swiglu --num-layers 2 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --kv-channels 16 --qk-layernorm --num-experts 8 --moe-ffn-hidden-size 32 "
    "--moe-router-topk 2 --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall "
    "--moe-router-load-balancing-type aux_loss --seq-length 32 --max-position-embeddings 64 "
    "--make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0 --rotary-base 1000000 "
    "--no-bias-swiglu-fusion --sequence-parallel --global-batch-size 4 --train-iters 2 --log-interval 1 --eval-iters 1"
) + TINY_DATA

# Megatron-MoE-ModelZoo's DeepSeek-V2-Lite model arguments, mock data: 27 -> 3 layers, 64 -> 8 experts.
DEEPSEEK_V2_LITE = _f(
    "--save-interval 100000 --attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 1 --bf16 "
    "--no-masked-softmax-fusion --disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --no-rope-fusion --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
    "--num-layers 3 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --kv-channels 16 "
    "--multi-latent-attention --kv-lora-rank 32 --v-head-dim 16 --qk-head-dim 16 --qk-layernorm "
    "--qk-pos-emb-head-dim 8 --num-experts 8 --moe-layer-freq ([0]+[1]*2) --moe-ffn-hidden-size 32 "
    "--moe-grouped-gemm --moe-router-score-function softmax --moe-router-topk 2 --moe-router-topk-scaling-factor 1.0 "
    "--moe-router-pre-softmax --moe-shared-expert-intermediate-size 64 --moe-aux-loss-coeff 1e-3 "
    "--moe-token-dispatcher-type alltoall --moe-token-drop-policy probs --moe-router-load-balancing-type seq_aux_loss "
    "--seq-length 32 --max-position-embeddings 32 --make-vocab-size-divisible-by 3200 --attention-softmax-in-fp32 "
    "--use-mcore-models --rotary-percent 1.0 --rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707 "
    "--mscale-all-dim 0.707 --sequence-parallel --global-batch-size 4 --train-iters 2"
) + TINY_DATA

# Megatron-MoE-ModelZoo's DeepSeek-V3 benchmark (sbatch_mfsdp_deepseek_v3.sh with USE_MEGATRON_FSDP=1,
# PROFILE=1, WANDB=1; TP=1, EP=8 -> 2, MBS=1, GBS=2048 -> 8) and its yaml's four extra flags, mock
# data: 61 -> 4 layers, 7168 -> 64 hidden, 256 -> 8 experts, MLA ranks shrunk.
DEEPSEEK_V3 = _f(
    "--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 2 "
    "--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce "
    "--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear "
    "--micro-batch-size 1 --global-batch-size 8 --train-samples 16 --exit-duration-in-mins 220 "
    "--no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 --recompute-granularity selective "
    "--recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine --seq-length 32 "
    "--split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader "
    "--num-layers 4 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4 --kv-channels 16 "
    "--max-position-embeddings 32 --position-embedding-type rope --rotary-base 10000 "
    "--make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
    "--untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --lr-decay-samples 12 --lr-warmup-samples 4 "
    "--lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 "
    "--num-experts 8 --moe-layer-freq [0]*1+[1]*3 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 "
    "--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2 --moe-token-dispatcher-type flex "
    "--moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4 "
    "--moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.5 "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 "
    "--moe-router-dtype fp32 --moe-permute-fusion --moe-router-force-load-balancing --q-lora-rank 32 "
    "--kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --rotary-scaling-factor 40 "
    "--mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 1 "
    "--eval-interval 100 --auto-detect-ckpt-format --load CKPT --save CKPT --save-interval 100 "
    "--dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard "
    "--log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 "
    "--logging-level 40 --tensorboard-dir TB --bf16 --enable-experimental "
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion "
    "--use-distributed-optimizer --calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor "
    "--fsdp-double-buffer --use-nccl-ub --megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16 "
    "--profile --profile-step-start 10 --profile-step-end 12 --profile-ranks 0 "
    "--wandb-project your_own_wandb_project --wandb-exp-name DeepSeek-V3-TP1EP2-MBS1GBS8- "
    "--no-save-optim --moe-router-fusion"
) + TINY_DATA

SCRIPTS = {"llama3_8b": LLAMA3_8B, "mixtral_8x7b": MIXTRAL_8X7B, "qwen3_30b_a3b": QWEN3_30B_A3B,
           "deepseek_v2_lite": DEEPSEEK_V2_LITE, "deepseek_v3": DEEPSEEK_V3}  # fmt: skip


@pytest.fixture(autouse=True)
def _root_logger_level():
    """--logging-level sets the root logger's level (Megatron's meaning): put it back after."""
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def argv(flags: list[tuple[str, list[str]]], tmp_path) -> list[str]:
    """The command line, paths in tmp_path."""
    paths = {"CKPT": str(tmp_path / "ckpt"), "TB": str(tmp_path / "tb"), "TOKENIZER_MODEL": str(tmp_path / "spm" / "tokenizer.model")}
    if any("TOKENIZER_MODEL" in values for _, values in flags) and not os.path.exists(paths["TOKENIZER_MODEL"]):
        write_sentencepiece_model(tmp_path / "spm")
    return [arg for flag, values in flags for arg in (flag, *(paths.get(v, v) for v in values))]


def _type(key: str):
    section, name = key.split(".")
    section_cls = {f.name: f.default_factory for f in dataclasses.fields(Config)}[section]
    return _unwrap_optional(typing.get_type_hints(section_cls)[name])[0]


def _read(tp, values: list[str]):
    """A flag's values as Megatron's argparse reads them (type=int, float, str; nargs lists)."""
    if typing.get_origin(tp) is list:
        return [_read(typing.get_args(tp)[0], [v]) for v in values]
    text = values[0]
    if tp == int | str:  # moe_layer_freq: an int, or a pattern string
        return int(text) if text.isdigit() else text
    return tp(text) if tp in (int, float) else text


def expected_keys(flags: list[tuple[str, list[str]]], tmp_path) -> dict[str, object]:
    """Each mapped flag's key -> the value the flag gives it (the last flag setting a key wins)."""
    args = argv(flags, tmp_path)
    said = {}
    i = 0
    while i < len(args):
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        said[args[i]] = args[i + 1 : j]
        i = j
    keys = {}
    for flag, values in said.items():
        m = flag_table().get(flag[2:])
        if m is None:
            assert flag[2:] in IGNORED, f"{flag} is neither mapped nor noted"
            continue
        if flag[2:] in CHOICES:  # a value that names a setting (None: the value sets nothing)
            text = CHOICES[flag[2:]][1][values[0]]
            if text is not None:
                keys[m.key] = {"true": True, "false": False}.get(text, text)
            continue
        keys[m.key] = m.value if m.flag.arity == "0" else _read(_type(m.key), values)
    tp = int(said.get("--tensor-model-parallel-size", ["1"])[0])
    if "--padded-vocab-size" not in said:  # Megatron's divisor is per tp rank (dtgpt/config/megatron_vocab.py)
        keys["model.make_vocab_size_divisible_by"] = int(said.get("--make-vocab-size-divisible-by", ["128"])[0]) * tp
    if "--no-check-for-nan-in-loss-and-grad" not in said:  # Megatron's NaN check stops the run (bf16: no scaler)
        keys["training.nan_policy"] = "stop"
    if "--calculate-per-token-loss" not in said:  # Megatron's mean of micro-batch means
        keys["training.calculate_per_token_loss"] = False
    return keys


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def dry_run_with_megatrons_values(name: str, flags: list[tuple[str, list[str]]], tmp_path) -> Config:
    """Each key a flag maps equals the value derived from Megatron's flags, and `--dry-run` accepts them."""
    args = argv(flags, tmp_path)
    cfg = load_config(None, args)
    for key, value in expected_keys(flags, tmp_path).items():
        assert _get(cfg, key) == value, (name, key, _get(cfg, key), value)
    assert run_main([*args, "--dry-run"], None, None) == 0
    return cfg


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_script_dry_runs_with_megatrons_values(name, tmp_path, capfd):
    flags = SCRIPTS[name]
    cfg = dry_run_with_megatrons_values(name, flags, tmp_path)
    assert cfg.model.position_embedding_type == "rope"
    vocab_multiple = dict(flags).get("--make-vocab-size-divisible-by", ["128"])[0]
    assert padded_vocabulary(cfg, 127) == int(vocab_multiple) * cfg.parallel.tensor_model_parallel_size  # Megatron's rows
    assert logging.getLogger().level == (40 if name == "deepseek_v3" else logging.WARNING)  # --logging-level 40
    out, err = capfd.readouterr()
    assert err == "" and f"{cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}" in out, (out, err)
    if name == "mixtral_8x7b":  # its own Llama2Tokenizer: the SentencePiece model's 400 pieces, padded to 128
        assert "vocab 400 -> 512 padded" in out, out


def test_noted_flags_of_the_scripts_say_what_dtgpt_does(tmp_path, capfd):
    """The DeepSeek-V3 benchmark's Megatron-FSDP, checkpoint-format, logging and wandb flags are
    accepted and named in rank 0's one note; its settings that are honoured are set."""
    cfg = load_config(None, argv(DEEPSEEK_V3, tmp_path))
    assert (cfg.training.nan_policy, cfg.checkpoint.save_optimizer, cfg.logging.logging_level) == ("skip", False, 40)
    assert cfg.profiling.profile_ranks == [0] and cfg.training.recompute_granularity == "selective"
    assert cfg.training.grad_reduce_in_bf16  # --megatron-fsdp-main-grads-dtype bf16 --megatron-fsdp-grad-comm-dtype bf16
    assert run_main(["--print-config", *argv(DEEPSEEK_V3, tmp_path)], None, None) == 0
    note = capfd.readouterr().out.splitlines()[0]
    for flag in ("--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params", "--init-model-with-meta-device",
                 "--fsdp-double-buffer", "--use-nccl-ub", "--auto-detect-ckpt-format", "--dist-ckpt-strictness log_all",
                 "--enable-experimental", "--wandb-project your_own_wandb_project"):  # fmt: skip
        assert f" {flag}" in note, flag


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bf16", "--megatron-fsdp-main-grads-dtype", "fp16"], "error: --megatron-fsdp-main-grads-dtype fp16 is refused: "
         "it accumulates gradients in fp16, and dtgpt accumulates them in fp32, or in bf16 under --bf16"),
        (["--bf16", "--megatron-fsdp-main-grads-dtype", "fp32", "--megatron-fsdp-grad-comm-dtype", "bf16"],
         "error: --megatron-fsdp-main-grads-dtype fp32 and --megatron-fsdp-grad-comm-dtype bf16 ask for different gradient "
         "dtypes: dtgpt accumulates and reduces gradients in one dtype"),
        (["--bf16", "--grad-reduce-in-bf16", "--megatron-fsdp-grad-comm-dtype", "fp32"],
         "error: --grad-reduce-in-bf16 and --megatron-fsdp-grad-comm-dtype fp32 ask for different gradient dtypes"),
        (["--megatron-fsdp-main-grads-dtype", "bf16"], "error: --megatron-fsdp-main-grads-dtype bf16 needs --bf16"),
        (["--data-parallel-sharding-strategy", "zero3"], "error: --data-parallel-sharding-strategy zero3 is not one of "
         "Megatron's choices: no_shard, optim, optim_grads, optim_grads_params"),
        (["--no-position-embedding"], "error: --no-position-embedding needs --position-embedding-type rope "
         "(--position-embedding-type is 'learned_absolute')"),
        (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
         "error: --use-rotary-position-embeddings and --position-embedding-type learned_absolute both set "
         "--position-embedding-type, to 'rope' and 'learned_absolute'; keep one"),
    ],
    ids=["main-grads-fp16", "grad-dtypes-differ", "grad-reduce-differs", "main-grads-bf16-without-bf16", "strategy", "no-position-learned", "rotary-contradiction"],
)
def test_refused_values_are_one_error_line(capfd, args, message):
    code = run_main(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", *args], None, None)
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(message) and "Traceback" not in err, err


def test_legacy_position_flags_and_padded_vocabulary_are_megatrons():
    """Megatron's legacy spellings: --use-rotary-position-embeddings is rope, and
    --no-position-embedding beside it changes nothing (the Llama-3.1 ModelZoo script);
    --padded-vocab-size P gives P rows and drops a --make-vocab-size-divisible-by beside it (Kimi-K2)."""
    cfg = load_config(None, ["--mock-data", "--use-rotary-position-embeddings", "--no-position-embedding"], check=False)
    assert cfg.model.position_embedding_type == "rope"
    cfg = load_config(None, ["--mock-data", "--make-vocab-size-divisible-by", "1", "--padded-vocab-size", "1024",
                             "--tensor-model-parallel-size", "2"], check=False)  # fmt: skip
    assert cfg.model.make_vocab_size_divisible_by == 1024 and padded_vocabulary(cfg, 1000) == 1024


@pytest.mark.parametrize(
    "args, path, policy",
    [
        (["--bf16"], None, "stop"),  # Megatron's check: a NaN stops the run
        (["--fp16"], None, "skip"),  # dynamic loss scaling: Megatron turns the check off, the scaler skips
        (["--fp16", "--loss-scale", "1024"], None, "stop"),  # a static scale: the check is on
        (["--bf16", "--no-check-for-nan-in-loss-and-grad"], None, "skip"),
        (["--bf16", "--training.nan_policy=skip"], None, "skip"),  # dtgpt's key says it
        (["--bf16"], "configs/debug.toml", "skip"),  # a config file keeps dtgpt's default
    ],
    ids=["bf16", "fp16-dynamic", "fp16-static", "flag", "key", "config-file"],
)
def test_a_launch_script_gets_megatrons_nan_check(args, path, policy):
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / path if path else None, ["--mock-data", *args], check=False)
    assert cfg.training.nan_policy == policy


@pytest.mark.parametrize(
    "args, path, per_token",
    [
        ([], None, False),  # Megatron's default: each micro-batch's mean, averaged
        (["--calculate-per-token-loss"], None, True),
        (["--training.calculate_per_token_loss=true"], None, True),  # dtgpt's key says it
        ([], "configs/debug.toml", True),  # a config file keeps dtgpt's default
    ],
    ids=["default", "flag", "key", "config-file"],
)
def test_a_launch_script_gets_megatrons_loss_normalisation(args, path, per_token):
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / path if path else None, ["--mock-data", "--bf16", *args], check=False)
    assert cfg.training.calculate_per_token_loss is per_token


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3_8b", "qwen3_30b_a3b"])
def test_example_script_trains_two_iterations_on_cpu(name, tmp_path, capfd, monkeypatch):
    """One dense and one MoE script, as shrunk above, train two iterations in one process."""
    from train import datasets_provider, model_provider

    monkeypatch.chdir(tmp_path)
    args = argv(SCRIPTS[name], tmp_path)
    assert run_main([*args, "--training.device=cpu"], model_provider, datasets_provider) == 0
    out = capfd.readouterr().out
    assert "iteration        2/       2" in out, out[-3000:]
