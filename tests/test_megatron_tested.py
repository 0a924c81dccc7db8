"""The training flags of Megatron-LM's own functional tests on train.py: a few of their
model_config.yaml flag sets (written out below as flags and values, the model shrunk and the data
mocked) go through `train.py --dry-run` with every mapped key holding what the flag says; their
refused values are one error line; --deterministic-mode's settings, --save-retain-interval's
retention and --log-progress's file are checked for real."""

from __future__ import annotations

import torch
import pytest

from dtgpt.checkpoint.retain import retire_previous
from dtgpt.cli import run_main
from dtgpt.config import load_config
from dtgpt.config.megatron_flags import translate
from dtgpt.config.megatron_tested import CHOICES
from dtgpt.config.sections import ConfigError
from dtgpt.determinism import CPU_NOTE, apply_determinism
from dtgpt.progress_log import ProgressLog, cumulative_start
from tests.test_megatron_scripts import TINY_DATA, _f, argv, dry_run_with_megatrons_values

CUDA_LABEL = torch.device("cuda")  # a device label only: these tests call no CUDA API (spies and env dicts stand in)

SHRUNK = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "

# tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances: 12 -> 2 layers,
# 512 -> 64 hidden, 1024 -> 32 tokens; its data, vocabulary and merges replaced by mock data.
MULTI_DIST_OPTIMIZER = _f(
    SHRUNK + "--log-params-norm --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard "
    "--log-timers-to-tensorboard --tensorboard-dir TB --micro-batch-size 4 --global-batch-size 32 --train-iters 50 "
    "--timing-log-level 0 --lr-decay-iters 320000 --save CKPT --load CKPT --split 949,50,1 --distributed-backend nccl "
    "--lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction 0.01 "
    "--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl transformer_engine "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --use-distributed-optimizer "
    "--num-distributed-optimizer-instances 2 --overlap-grad-reduce --overlap-param-gather --deterministic-mode "
    "--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist "
    "--dist-ckpt-strictness log_all --bf16 --attention-backend unfused --log-memory-to-tensorboard --async-save "
    "--use-persistent-ckpt-worker"
) + TINY_DATA

# gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic, shrunk as above.
CP_A2A_P2P = _f(
    SHRUNK + "--micro-batch-size 4 --global-batch-size 32 --train-iters 50 --lr-decay-iters 320000 --save CKPT "
    "--load CKPT --split 949,50,1 --lr 0.00015 --lr-decay-style cosine --min-lr 1e-05 --weight-decay 1e-2 "
    "--clip-grad 1.0 --lr-warmup-fraction 0.01 --log-interval 1 --save-interval 10000 --eval-interval 1000 "
    "--eval-iters 10 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --context-parallel-size 4 "
    "--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 --sequence-parallel --hidden-dropout 0.0 "
    "--attention-dropout 0.0 --no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models "
    "--ckpt-format torch_dist --dist-ckpt-strictness log_all --bf16 --attention-backend flash --async-save "
    "--use-persistent-ckpt-worker"
) + TINY_DATA

# gpt/gpt3_15b_8t_release without its token-threshold batch schedule (one global batch here): 32 -> 2 layers, 6144 -> 64 hidden, tp 8 -> 2.
RELEASE_15B = _f(
    "--distributed-timeout-minutes 60 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --use-mcore-models --sequence-parallel "
    "--disable-bias-linear --micro-batch-size 4 --global-batch-size 8 --train-samples 64 --manual-gc "
    "--transformer-impl transformer_engine --split 99,1,0 --no-mmap-bin-files --apply-layernorm-1p "
    "--untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --rotary-percent 0.5 "
    "--squared-relu --num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 32 --max-position-embeddings 32 --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 "
    "--weight-decay 0.1 --lr-decay-samples 48 --lr-warmup-samples 8 --lr 0.00045 --min-lr 4.5e-05 "
    "--decoupled-lr 0.0005 --decoupled-min-lr 4.5e-05 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 "
    "--eval-iters 32 --eval-interval 2000 --save CKPT --load CKPT --save-interval 1000 --save-retain-interval 5000 "
    "--init-method-std 0.0134 --log-timers-to-tensorboard --log-interval 100 --tensorboard-dir TB "
    "--wandb-project megatron-core-release-runs --wandb-entity adlr --wandb-exp-name release --bf16 "
    "--exit-interval 51000 --async-save --use-persistent-ckpt-worker --log-progress --optimizer adam --rerun-mode validate_results "
    "--eval-global-batch-size 8 --timing-log-option minmax"
) + TINY_DATA

FUNCTIONAL_TESTS = {"multi_dist_optimizer": MULTI_DIST_OPTIMIZER, "cp_a2a_p2p": CP_A2A_P2P, "release_15b": RELEASE_15B}


@pytest.mark.parametrize("name", FUNCTIONAL_TESTS)
def test_functional_test_flags_dry_run_with_megatrons_values(name, tmp_path, capfd):
    dry_run_with_megatrons_values(name, FUNCTIONAL_TESTS[name], tmp_path)
    out, err = capfd.readouterr()
    assert err == "" and "2 layers, hidden 64" in out, (out, err)


def test_derived_keys_of_the_functional_tests(tmp_path):
    cfg = load_config(None, argv(MULTI_DIST_OPTIMIZER, tmp_path))
    assert cfg.training.deterministic and cfg.parallel.data_parallel_replicate_size == 2  # Megatron's 2 instances
    cfg = load_config(None, argv(RELEASE_15B, tmp_path))
    assert (cfg.checkpoint.save_retain_interval, cfg.logging.log_progress, cfg.model.squared_relu) == (5000, True, True)
    assert not load_config(None, argv(CP_A2A_P2P, tmp_path)).training.deterministic
    every = ["--mock-data", "--check-weight-hash-across-dp-replicas-interval", "10"]
    assert load_config(None, every).training.check_weight_hash_across_dp_replicas_interval == 10


def test_noted_flags_are_named_in_the_one_note(tmp_path, capfd):
    assert run_main(["--print-config", *argv(CP_A2A_P2P, tmp_path)], None, None) == 0
    note = capfd.readouterr().out.splitlines()[0]
    for flag in ("--cp-comm-type a2a+p2p", "--hierarchical-context-parallel-sizes 2 2", "--use-persistent-ckpt-worker"):
        assert f" {flag}" in note, flag


# The rest of the functional tests' training flags, as they pass them (the resume, MoE overlap, offloading, op-fuser
# and test-mode cases); each is accepted with a note.
NOTED_ELSEWHERE = (
    "--verify-integrity", "--async-strategy mcore", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
    "--use-transformer-engine-op-fuser", "--fine-grained-activation-offloading",
    "--offload-modules expert_fc1 moe_act attn_norm mlp_norm qkv_linear core_attn attn_proj", "--test-mode",
    "--error-injection-rate 0", "--error-injection-type persistent_error", "--wandb-entity adlr",
)  # fmt: skip


def test_the_other_functional_test_flags_are_named_in_the_one_note(tmp_path, capfd):
    args = argv(CP_A2A_P2P, tmp_path) + [a for flag in NOTED_ELSEWHERE for a in flag.split()]
    cfg, plain = load_config(None, args), load_config(None, argv(CP_A2A_P2P, tmp_path))
    assert cfg == plain  # nothing trained changes
    assert run_main(["--print-config", *args], None, None) == 0
    note = capfd.readouterr().out.splitlines()[0]
    for flag in NOTED_ELSEWHERE:
        assert f" {flag}" in note, flag


@pytest.mark.parametrize(
    "args, message",
    [
        (["--optimizer", "lion"], "error: --optimizer lion is refused: dtgpt builds Megatron's adam (AdamW), sgd (SGD with momentum) and muon"),
        (["--megatron-fsdp-main-params-dtype", "bf16"], "error: --megatron-fsdp-main-params-dtype bf16 is refused: "
         "it keeps master weights in bf16"),
        (["--cuda-graph-impl", "all"], "error: --cuda-graph-impl all is not one of Megatron's choices: none, local"),
        (["--cp-comm-type", "p2p", "ring"], "error: --cp-comm-type ring is not one of Megatron's choices: p2p, a2a"),
        (["--global-batch-size", "8", "--eval-global-batch-size", "16"], "error: --eval-global-batch-size 16 is "
         "refused: dtgpt evaluates --global-batch-size 8 samples per evaluation iteration"),
        (["--save-interval", "10", "--save-retain-interval", "15"], "error: --save-retain-interval 15 must be 0 or "
         "a positive multiple of --save-interval 10"),
        (["--squared-relu", "--swiglu"], "error: --squared-relu and --swiglu: choose one "
         "activation (Megatron refuses both)"),
        (["--error-injection-rate", "100", "--error-injection-type", "transient_error"], "error: "
         "--error-injection-rate 100 is refused: it injects mismatches into the reruns of Megatron's rerun state "
         "machine, which dtgpt does not have"),
        (["--use-mup"], "error: --use-mup is refused: maximal update parametrisation rescales the initialisation"),
        (["--mup-base-hidden-size", "256"], "error: --mup-base-hidden-size is refused: it sets the base width of "
         "--use-mup, which dtgpt does not build"),
        (["--async-strategy", "torch"], "error: --async-strategy torch is not one of Megatron's choices: nvrx, mcore"),
        (["--error-injection-type", "hang"], "error: --error-injection-type hang is not one of Megatron's choices"),
        (["--offload-modules", "core_attn", "mlp"], "error: --offload-modules mlp is not one of Megatron's choices"),
        (["--ckpt-format", "foo"], "error: --ckpt-format foo is not one of Megatron's choices: torch, torch_dist, "
         "torch_dcp, fsdp_dtensor"),
        (["--transformer-impl", "foo"], "error: --transformer-impl foo is not one of Megatron's choices: local, "
         "transformer_engine, inference_optimized"),
        (["--dataloader-type", "foo"], "error: --dataloader-type foo is not one of Megatron's choices: single, "
         "cyclic, external"),
        (["--empty-unused-memory-level", "3"], "error: --empty-unused-memory-level 3 is not one of Megatron's "
         "choices: 0, 1, 2"),
    ],
    ids=["sgd", "main-params-bf16", "cuda-graph-impl", "cp-comm-type", "eval-batch", "retain", "squared-relu",
         "error-injection", "mup", "mup-base", "async-strategy", "error-injection-type", "offload-modules",
         "ckpt-format", "transformer-impl", "dataloader-type", "empty-unused-memory-level"],
)
def test_refused_values_are_one_error_line(capfd, args, message):
    code = run_main(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", *args], None, None)
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(message) and "Traceback" not in err, err


def test_every_megatron_choice_of_a_flag_is_accepted_or_refused_with_its_reason():
    """Each of Megatron's values parses (the flag is noted or ignored), or is one line naming dtgpt's reason."""
    for name, choices in CHOICES.items():
        for value, refused in choices.items():
            try:
                translate(["--" + name, value])
            except ConfigError as error:
                assert refused is not None and f"--{name} {value} is refused: " in str(error), (name, value, error)
            else:
                assert refused is None, (name, value)


def test_deterministic_mode_sets_cuda_determinism_and_says_so_on_cpu():
    env: dict[str, str] = {}
    assert apply_determinism(torch.device("cpu"), env) == CPU_NOTE and env == {}
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        assert apply_determinism(CUDA_LABEL, env) is None
        assert torch.are_deterministic_algorithms_enabled()
        assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
        kept = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring,CollnetChain"}
        apply_determinism(CUDA_LABEL, kept)
        assert kept == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring,CollnetChain"}  # the user's, deterministic
        with pytest.raises(ConfigError, match="needs NCCL_ALGO unset or one of Ring"):
            apply_determinism(CUDA_LABEL, {"NCCL_ALGO": "Tree"})
    finally:
        torch.use_deterministic_algorithms(False)


def test_retire_previous_keeps_the_multiples_and_the_newest(tmp_path):
    for i in (10, 20, 30):
        (tmp_path / f"iter_{i:07d}").mkdir()
    assert retire_previous(tmp_path, 10, 20, 20) == [tmp_path / "iter_0000010"]
    assert retire_previous(tmp_path, 20, 30, 20) == []  # a multiple stays
    assert retire_previous(tmp_path, 30, 30, 20) == []  # the newest (a save again at the same iteration)
    assert retire_previous(tmp_path, 30, 40, 0) == []  # no interval: nothing deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000020", "iter_0000030"]


def test_cumulative_throughput_counts_from_the_first_job_at_this_gpu_count(tmp_path):
    log = ProgressLog(str(tmp_path), 8, 1e6, 1000)
    log.start(0)
    log.saved(10, 100)
    log.world_size = 16  # a job at another GPU count: the count restarts
    log.start(100)
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[3] for line in lines] == ["Starting job", "Saved checkpoint", "Starting job"]
    assert lines[1].split("\t")[4:] == ["Iteration: 10", lines[1].split("\t")[5], lines[1].split("\t")[6],
                                        "Floating-point operations: 1.00e+11", "Tokens (in billions): 0.00"]  # fmt: skip
    start = cumulative_start(tmp_path / "progress.txt", 16)
    assert start is not None and start[1] == 1e11  # the operations saved before this GPU count's first start
    assert cumulative_start(tmp_path / "progress.txt", 4) is None


@pytest.mark.slow
def test_save_retain_interval_and_log_progress_on_a_real_run(tmp_path, capfd, monkeypatch):
    """Saves at 2, 4, ..., 10 with a retain interval of 4 leave 4, 8 and the newest, 10; progress.txt
    says when the job started, each save and each deletion, in Megatron's format. --deterministic-mode
    on CPU says there is nothing to set."""
    from train import datasets_provider, model_provider

    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    args = [*(a for f, v in TINY_DATA for a in (f, *v)), *SHRUNK.split(), "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "10", "--lr", "1e-4", "--save", str(ckpt),
            "--save-interval", "2", "--save-retain-interval", "4", "--log-progress", "--log-interval", "5",
            "--eval-iters", "0", "--deterministic-mode", "--training.device=cpu"]  # fmt: skip
    assert run_main(args, model_provider, datasets_provider) == 0
    assert CPU_NOTE in capfd.readouterr().out
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000004", "iter_0000008", "iter_0000010"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    events = [line.split("\t")[3:5] for line in (ckpt / "progress.txt").read_text().splitlines()]
    assert events == [["Starting job"], ["Saved checkpoint", "Iteration: 2"], ["Saved checkpoint", "Iteration: 4"],
                      ["Deleted checkpoint", "Iteration: 2"], ["Saved checkpoint", "Iteration: 6"],
                      ["Saved checkpoint", "Iteration: 8"], ["Deleted checkpoint", "Iteration: 6"],
                      ["Saved checkpoint", "Iteration: 10"]]  # fmt: skip
    saved = (ckpt / "progress.txt").read_text().splitlines()[-1].split("\t")
    assert saved[2] == "# GPUs: 1" and saved[-1] == "Tokens (in billions): 0.00" and saved[5].startswith("Job throughput: ")
