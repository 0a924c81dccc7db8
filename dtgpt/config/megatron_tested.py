"""Training flags that Megatron-LM's own functional tests pass (tests/functional_tests/test_cases/
*/model_config.yaml), with what dtgpt does for each.

Those accepted with a note choose Megatron's checkpoint writers, CUDA graphs, kernel fusions,
overlap schedules, activation offloading, rank placement, process groups, consistency checks or
logging extras: none changes the model, the data or the arithmetic dtgpt trains with. Where one of
their values would (an optimizer other than Adam, SGD or Muon, Megatron-FSDP master weights in bf16), or where a
flag asks for what dtgpt does not build (MuP, rerun error injection), it is refused with one line
saying why. The notes are the "Megatron's functional tests" section of docs/megatron_flags.md.
"""

from __future__ import annotations

from dtgpt.config.megatron_noted import note_lines
from dtgpt.config.sections import Config, ConfigError

TESTED_SCRIPTS = [
    "The training flags of Megatron-LM's functional tests (the GPT, MoE and Mixtral",
    "`tests/functional_tests/test_cases/*/model_config.yaml`) run too; tests/test_megatron_tested.py passes a few",
    "of their flag sets through `--dry-run`. Their inference, RL, fp8/fp4, FIM and linear-attention flags",
    "stay refused, as do `--use-mup` (maximal update parametrisation) and a positive `--error-injection-rate`",
    "(faults injected into Megatron's reruns). Flags mapped or built for them:",
    "",
    "- `--deterministic-mode`: `training.deterministic = true`: on CUDA, torch's deterministic algorithms (an op",
    "  without a deterministic kernel raises), `CUBLAS_WORKSPACE_CONFIG=:4096:8` and `NCCL_ALGO=Ring` unless set to",
    "  another deterministic value; on CPU a line says nothing needs setting.",
    "- `--num-distributed-optimizer-instances N`: `parallel.data_parallel_replicate_size = N`: Megatron shards the",
    "  optimizer within each of N data-parallel groups and replicates it across them, as dtgpt's dp_replicate does.",
    "- `--optimizer sgd --sgd-momentum M`: `optimizer.optimizer = \"sgd\"`, `optimizer.sgd_momentum = M`: torch's SGD",
    "  as megatron-core builds it, on the same groups, schedule and clipping as Adam (docs/schedules.md).",
    "- `--optimizer muon` (or `dist_muon`, or with `--use-distributed-optimizer`) and the `--muon-*` flags:",
    "  `optimizer.optimizer = \"muon\"` and the `optimizer.muon_*` keys: megatron-core's Muon for its matrices, AdamW",
    "  for the rest, each matrix orthogonalised whole on every layout (docs/schedules.md); lion, soap and",
    "  adaptive_muon stay refused.",
    "- `--save-retain-interval R`: `checkpoint.save_retain_interval`: after each save the previous checkpoint is",
    "  deleted unless its iteration is a multiple of R; the newest always stays (docs/checkpoints.md).",
    "- `--check-weight-hash-across-dp-replicas-interval N`: every N iterations the dp_replicate replicas compare a",
    "  SHA-256 of their weights and a difference stops the run (dtgpt/parallel/replica_check.py).",
    "- `--log-progress`: `logging.log_progress`: Megatron's progress.txt in the save directory (docs/logging.md).",
    "- `--squared-relu`: `model.squared_relu = true`: the dense MLP is fc2(relu(fc1(x))^2), as megatron-core's",
    "  (tests/test_squared_relu.py compares the two); refused beside `--swiglu` (as Megatron) or `--num-experts`.",
    "",
    "Accepted with a note, each changing nothing that is trained:",
]

NOTED = {
    "use-persistent-ckpt-worker": "keeps Megatron's asynchronous-save worker process alive between saves; dtgpt's "
    "`--async-save` writes from a background thread of each rank (DCP's async save)",
    "dist-ckpt-optim-fully-reshardable": "dtgpt's optimizer state is always saved mesh-free (DCP keyed by parameter "
    "name), so it loads at any other layout",
    "ckpt-fully-parallel-save": "which ranks write which shards of Megatron's torch_dist files; under DCP every rank "
    "writes its own shard, each replicated tensor once",
    "no-ckpt-fully-parallel-save": "as --ckpt-fully-parallel-save",
    "async-ckpt-use-cpu-shm": "stages Megatron's asynchronous save in shared CPU memory; DCP stages its own copy",
    "cuda-graph-impl": "every choice (none, local, transformer_engine, full_iteration) is accepted: a CUDA graph "
    "replays the kernels it captured, so it changes launch cost, never the arithmetic; dtgpt captures no graphs "
    "(`--training.compile` is its fusion path)",
    "enable-cuda-graph": "as --cuda-graph-impl local",
    "cuda-graph-modules": "as --cuda-graph-impl",
    "apply-query-key-layer-scaling": "Megatron divides the attention scores by the layer number before its fp16 "
    "softmax and multiplies them back inside it (and keeps that softmax in fp32), so the probabilities are the "
    "same up to rounding; dtgpt computes every softmax in fp32 from unscaled scores",
    "muon-use-syrk": "computes Muon's Gram matrices with a Triton SYRK kernel on some CUDA GPUs (Megatron falls back "
    "to a matmul elsewhere): the same products; dtgpt uses torch's matmul",
    "use-tp-pp-dp-mapping": "orders ranks tp, pp, dp instead of tp, cp, dp, pp: only which GPU holds which shard "
    "changes; dtgpt's mesh is always pp, dp_replicate, dp_shard, cp, tp (outer to inner)",
    "rerun-mode": "every choice is accepted: Megatron's validate_results re-runs an iteration whose loss is "
    "non-finite to tell a hardware fault from a bug before it stops, report_stats measures the variation of "
    "repeated runs; dtgpt never reruns an iteration and stops or skips per `training.nan_policy`, which is what "
    "is trained either way",
    "timing-log-option": "every choice is accepted: dtgpt's timer block always prints each phase's (min, max) over "
    "ranks, Megatron's default minmax",
    "straggler-minmax-count": "the number of slowest and fastest ranks Megatron's straggler detector reports",
    "te-rng-tracker": "Transformer Engine's implementation of the per-tensor-parallel-rank dropout streams; "
    "dtgpt has its own (dtgpt/parallel/rng.py)",
    "defer-embedding-wgrad-compute": "delays the output layer's weight gradient to overlap it with pipeline "
    "communication; the gradient is the same",
    "wgrad-deferral-limit": "as --defer-embedding-wgrad-compute",
    "overlap-p2p-communication-warmup-flush": "overlaps pipeline sends and receives in the warm-up and flush phases",
    "microbatch-group-size-per-virtual-pipeline-stage": "the order in which Megatron's interleaved schedule runs "
    "micro-batches on each virtual stage; the gradients of the same micro-batches are summed whatever the order "
    "(dtgpt's interleaved schedule is torch.distributed.pipelining's)",
    "ddp-average-in-collective": "averages gradients inside the reduction instead of scaling them before it; "
    "dtgpt's gradient is the sum of token losses over the global batch's loss tokens either way",
    "outer-dp-sharding-strategy": "no_shard and optim are accepted: the outer data-parallel dim "
    "(`parallel.data_parallel_replicate_size`) holds replicas; optim would shard their optimizer state too, "
    "which changes memory only",
    "overlap-param-gather-with-optimizer-step": "overlaps the parameter all-gather with the optimizer step",
    "disable-gloo-process-groups": "Megatron's gloo side groups for its CPU checkpoint paths; dtgpt's NCCL runs "
    "build none of those",
    "cp-comm-type": "every choice (p2p, a2a, allgather, a2a+p2p, per layer or one for all) is accepted: each "
    "exchanges keys and values differently for the same attention; dtgpt's context parallelism all-gathers them "
    "(dtgpt/parallel/context.py)",
    "hierarchical-context-parallel-sizes": "the group sizes of --cp-comm-type a2a+p2p, as that flag",
    "megatron-fsdp-main-params-dtype": "fp32 is accepted: dtgpt keeps master weights in fp32; bf16, fp16 and auto "
    "are refused",
    "eval-global-batch-size": "accepted equal to `--global-batch-size` (Megatron's default): dtgpt evaluates "
    "global-batch-size samples per evaluation iteration; another value is refused",
    "verify-integrity": "Megatron writes a SHA-256 of every torch_dist file beside its checkpoint and re-hashes them "
    "before a load; dtgpt always records the size and CRC-32 of every file and item it saves and checks what it "
    "loads, falling back to the previous checkpoint on a mismatch (docs/checkpoints.md); the integrity.json of a "
    "Megatron checkpoint is not read",
    "async-strategy": "nvrx and mcore are accepted: which library runs Megatron's asynchronous save (NVIDIA "
    "Resiliency Extension's or megatron-core's); dtgpt's `--async-save` is DCP's async save",
    "overlap-moe-expert-parallel-comm": "overlaps one micro-batch's expert-parallel all-to-all with another's "
    "computation in Megatron's 1F1B schedule; the same micro-batches give the same gradients in either order",
    "delay-wgrad-compute": "computes weight gradients later, for the overlap of --overlap-moe-expert-parallel-comm; "
    "the gradient is the same",
    "use-transformer-engine-op-fuser": "lets Transformer Engine fuse sequences of operations into fewer kernels; "
    "dtgpt's fusion path is `--training.compile`",
    "fine-grained-activation-offloading": "moves the inputs of the --offload-modules to host memory until the "
    "backward needs them, which changes device memory only: dtgpt keeps activations on the device (recomputation, "
    "`--recompute-modules`, is its way to save that memory; scripts/plan.py shows what a layout needs)",
    "offload-modules": "as --fine-grained-activation-offloading",
    "test-mode": "Megatron's real-time check that every data-parallel rank holds the same q/k layernorm weights "
    "(it also turns off one fused qkv and rope kernel); dtgpt does not run it: under dp_shard each weight is held "
    "once, and `--check-weight-hash-across-dp-replicas-interval` compares the dp_replicate replicas",
    "error-injection-type": "every choice (correct_result, transient_error, persistent_error) is accepted: it "
    "acts only with a positive --error-injection-rate, which is refused",
    "error-injection-rate": "0 is accepted (Megatron's default: nothing injected); a positive rate is refused",
}
"""flag -> what dtgpt does instead (accepted, and named in the one note rank 0 prints)."""

NEWER = """
    megatron-fsdp-main-params-dtype cuda-graph-modules* eval-global-batch-size async-ckpt-use-cpu-shm!
    verify-integrity! async-strategy use-transformer-engine-op-fuser!
    use-mup! mup-base-hidden-size muon-use-syrk!
"""
"""Flags newer than megatron-core 0.16.1 among these, in megatron_names' notation."""

REFUSED = ""
GRAD_DTYPES = {"fp32": None, "auto": None, "bf16": None, "fp16": REFUSED}
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")  # fmt: skip
LIST_CHOICES = {
    "cp-comm-type": ("p2p", "a2a", "allgather", "a2a+p2p"),
    "offload-modules": ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                        "fused_group_mlp", "gdp_qkv"),
}  # fmt: skip
"""Megatron's choices for each value of the flags that take a list."""
CHOICES = {
    "cuda-graph-impl": dict.fromkeys(("none", "local", "transformer_engine", "full_iteration")),
    "rerun-mode": dict.fromkeys(("disabled", "validate_results", "report_stats")),
    "timing-log-option": dict.fromkeys(("max", "minmax", "all")),
    "outer-dp-sharding-strategy": dict.fromkeys(("no_shard", "optim")),
    "megatron-fsdp-main-params-dtype": {"fp32": None, "bf16": REFUSED, "fp16": REFUSED, "auto": REFUSED},
    "optimizer": {**dict.fromkeys(("adam", "sgd", "muon", "dist_muon")), **dict.fromkeys(("lion", "soap", "adaptive_muon"), REFUSED)},
    "async-strategy": dict.fromkeys(("nvrx", "mcore")),
    "error-injection-type": dict.fromkeys(("correct_result", "transient_error", "persistent_error")),
    "ckpt-format": dict.fromkeys(("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")),
    "transformer-impl": dict.fromkeys(("local", "transformer_engine", "inference_optimized")),
    "dataloader-type": dict.fromkeys(("single", "cyclic", "external")),
    "cross-entropy-fusion-impl": dict.fromkeys(("native", "te")),
    "attention-backend": dict.fromkeys(("flash", "fused", "unfused", "local", "auto")),
    "empty-unused-memory-level": dict.fromkeys(("0", "1", "2")),
    "data-parallel-sharding-strategy": dict.fromkeys(("no_shard", "optim", "optim_grads", "optim_grads_params")),
    "dist-ckpt-strictness": dict.fromkeys(STRICTNESS),
    "megatron-fsdp-main-grads-dtype": GRAD_DTYPES,
    "megatron-fsdp-grad-comm-dtype": GRAD_DTYPES,
}
"""Megatron's choices for the flags that take one (its parser's, core_v0.16.1 and newer), whatever dtgpt does
with the flag; a value mapped to REFUSED is refused with its reason in WHY_REFUSED."""

WHY_REFUSED = {
    "megatron-fsdp-main-grads-dtype": "it accumulates gradients in {value}, and dtgpt accumulates them in fp32, or in "
    "bf16 under --bf16; give fp32 or bf16 (fp16 runs: --accumulate-allreduce-grads-in-fp32 chooses)",
    "megatron-fsdp-grad-comm-dtype": "it reduces gradients over data-parallel ranks in {value}, and dtgpt reduces them "
    "in fp32, or in bf16 under --bf16; give fp32 or bf16 (fp16 runs: --accumulate-allreduce-grads-in-fp32 chooses)",
    "megatron-fsdp-main-params-dtype": "it keeps master weights in {value} (auto: the parameters' dtype), and dtgpt "
    "keeps them in fp32 (Megatron's mixed-precision regime); drop the flag or give fp32",
    "optimizer": "dtgpt builds Megatron's adam (AdamW), sgd (SGD with momentum) and muon (dist_muon), not {value}; "
    "drop the flag or give adam, sgd or muon",
    "error-injection-rate": "it injects mismatches into the reruns of Megatron's rerun state machine, which dtgpt "
    "does not have (it never reruns an iteration); dtgpt's fault drills are the [faults] keys (docs/faults.md); "
    "drop the flag or give 0",
    "use-mup": "maximal update parametrisation rescales the initialisation, the learning rates, the attention "
    "scale and the output logits by the width multiplier, which dtgpt does not build; drop the flag",
    "mup-base-hidden-size": "it sets the base width of --use-mup, which dtgpt does not build; drop the flag",
}

REFUSED_FLAGS = ("use-mup", "mup-base-hidden-size")
"""Flags refused whatever their value, each with its reason in WHY_REFUSED."""


def check_choice(name: str, value: str, choices: dict, why_refused: dict[str, str]) -> None:
    """Refuse a value outside Megatron's `choices` for flag `name`, or one mapped to a refusal (not None)."""
    if value not in choices:
        raise ConfigError(f"--{name} {value} is not one of Megatron's choices: {', '.join(choices)}")
    if choices[value] is not None:
        raise ConfigError(f"--{name} {value} is refused: {why_refused[name].format(value=value)}")


def check_tested_value(name: str, values: list[str]) -> None:
    """Refuse a value outside Megatron's choices, or one that would change what is trained."""
    if name in REFUSED_FLAGS:
        raise ConfigError(f"--{name} is refused: {WHY_REFUSED[name]}")
    if name == "error-injection-rate" and values[0] != "0":
        raise ConfigError(f"--{name} {values[0]} is refused: {WHY_REFUSED[name]}")
    for value in values if name in LIST_CHOICES else ():
        if value not in LIST_CHOICES[name]:
            raise ConfigError(f"--{name} {value} is not one of Megatron's choices: {', '.join(LIST_CHOICES[name])}")
    if name in CHOICES:
        check_choice(name, values[0], CHOICES[name], WHY_REFUSED)


EVAL_BATCH = "--eval-global-batch-size"


def check_eval_batch(cfg: Config, ignored: list[str]) -> None:
    """--eval-global-batch-size other than the training global batch is refused (checked once the
    config is read, wherever --global-batch-size stands on the line)."""
    for spelled in ignored:
        flag, _, value = spelled.partition(" ")
        if flag == EVAL_BATCH and value != str(cfg.training.global_batch_size):
            raise ConfigError(
                f"{EVAL_BATCH} {value} is refused: dtgpt evaluates training.global_batch_size="
                f"{cfg.training.global_batch_size} samples per evaluation iteration; drop the flag or give that value"
            )


def tested_section() -> list[str]:
    return note_lines(NOTED)
