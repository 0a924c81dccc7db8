"""Megatron-LM flags that Megatron's example launch scripts pass and dtgpt accepts with a note,
each with what dtgpt does instead; a few accept only some of their values.

These choose Megatron's data-parallel implementation (Megatron-FSDP and its buffers), its
checkpoint-format detection, its logging back ends or its feature gates: none changes the model,
the data or the arithmetic dtgpt trains with. Their notes are the "Megatron's example scripts"
section of docs/megatron_flags.md. A value that would change the arithmetic in a way dtgpt does not
build is refused with one line saying why.
"""

from __future__ import annotations


NOTED = {
    "use-megatron-fsdp": "dtgpt's data parallelism is always FSDP2 (`fully_shard` over the dp_shard mesh dim): "
    "parameters, gradients and optimizer state are sharded over it, gradients kept and reduced in fp32 (in bf16 "
    "under `--megatron-fsdp-main-grads-dtype bf16`, see above)",
    "data-parallel-sharding-strategy": "every strategy (no_shard, optim, optim_grads, optim_grads_params) is accepted: "
    "dtgpt shards parameters, gradients and optimizer state over dp_shard whatever the choice, which changes memory "
    "and traffic only; `--parallel.fsdp_reshard_after_forward=always` re-gathers parameters in every micro-batch as "
    "optim_grads_params does, `--parallel.data_parallel_replicate_size` replicates as no_shard does",
    "init-model-with-meta-device": "dtgpt always builds the model on the meta device and materialises it after sharding",
    "fsdp-double-buffer": "a Megatron-FSDP communication buffer scheme; FSDP2 manages its own buffers",
    "use-nccl-ub": "NCCL user-buffer registration of Megatron's communication buffers",
    "fsdp-manual-registration": "NCCL user-buffer registration of Megatron-FSDP's buffers",
    "auto-detect-ckpt-format": "dtgpt always detects a checkpoint's format from its files (its own DCP, Megatron's "
    "torch_dist or per-rank `torch`)",
    "dist-ckpt-strictness": "every value is accepted: dtgpt's load of a Megatron checkpoint is strict whatever it says "
    "(a missing or an unexpected model tensor is one error line naming it, never a partial load), so a load that "
    "succeeds reads what Megatron would",
    "wandb-project": "Weights & Biases is not a dependency of dtgpt: metrics go to TensorBoard (`--tensorboard-dir`) "
    "and to `logging.metrics_file`",
    "wandb-exp-name": "as --wandb-project",
    "wandb-save-dir": "as --wandb-project",
    "wandb-entity": "as --wandb-project",
    "enable-experimental": "gates Megatron's experimental code paths; dtgpt has none behind it",
    "no-position-embedding": "accepted beside rotary positions (`--position-embedding-type rope` or "
    "`--use-rotary-position-embeddings`), where the model has no learned position table anyway; refused otherwise, "
    "as Megatron refuses it",
    "trust-remote-code": "dtgpt's HuggingFaceTokenizer reads tokenizer.json with the `tokenizers` library and never "
    "runs code from the tokenizer's directory",
    "apply-residual-connection-post-layernorm": "megatron-core's GPTModel, which pretrain_gpt.py builds (the legacy "
    "model, `--use-legacy-models`, is refused), never reads it (core 0.16.1): its layers add each sub-layer to the "
    "block's input, the norm's output is no residual, so the model is the same with or without it, as in dtgpt",
}
"""flag -> what dtgpt does instead (accepted, and named in the one note rank 0 prints)."""

EXAMPLE_SCRIPTS = [
    "These run on `train.py` as written, with `train.py` in place of `pretrain_gpt.py` (tests/test_megatron_scripts.py",
    "passes each one's flags, shrunk to a small model, through `--dry-run`): Megatron-LM's",
    "`examples/gpt3/train_gpt3_175b_distributed.sh`, `examples/llama/train_llama3_8b_h100_fp8.sh` (with",
    "`DTYPE=bf16`: dtgpt has no fp8), `examples/mixtral/train_mixtral_8x7b_distributed.sh`, and Megatron-MoE-ModelZoo's",
    "Qwen3-30B-A3B, DeepSeek-V2-Lite and DeepSeek-V3 benchmark flag sets, every flag of theirs taken (the Mixtral",
    "script with its own `--tokenizer-type Llama2Tokenizer --tokenizer-model`, a SentencePiece model: docs/data.md,",
    "\"Tokenizers\"). Flags mapped for them:",
    "",
    "- `--calculate-per-token-loss`: `training.calculate_per_token_loss = true`; without it a launch script gets",
    "  Megatron's `false` (each micro-batch's mean, averaged), and a config file dtgpt's `true` (docs/schedules.md).",
    "- `--use-rotary-position-embeddings` (legacy): `model.position_embedding_type = \"rope\"`; beside another",
    "  `--position-embedding-type` it is refused as two values for one key.",
    "- `--no-check-for-nan-in-loss-and-grad`: `training.nan_policy = \"skip\"`; without it a launch script gets",
    "  Megatron's check, `stop` (`skip` under fp16 with dynamic loss scaling, where Megatron skips the step).",
    "- `--no-save-optim`: `checkpoint.save_optimizer = false`: the checkpoint holds no optimizer state, LR schedule or",
    "  loss scale, and a run resuming from it starts those fresh, as `--no-load-optim` does.",
    "- `--padded-vocab-size P`: the vocabulary has P rows (`model.make_vocab_size_divisible_by = P`; a",
    "  `--make-vocab-size-divisible-by` beside it is dropped, as Megatron drops it).",
    "- `--megatron-fsdp-main-grads-dtype` and `--megatron-fsdp-grad-comm-dtype` (the dtype Megatron-FSDP accumulates",
    "  gradients in, and the one it reduce-scatters them in; auto: the parameters' dtype, and the main gradients'):",
    "  bf16 sets `training.grad_reduce_in_bf16 = true` (Megatron's `--grad-reduce-in-bf16`: both in bf16 over fp32",
    "  master weights; it needs `--bf16`), fp32 sets it false; auto sets nothing, and dtgpt keeps fp32 (Megatron-FSDP's",
    "  auto follows the gradients' dtype, bf16 under `--bf16`: give bf16 for that). dtgpt accumulates and reduces in",
    "  one dtype, so the two flags (or `--grad-reduce-in-bf16`) in two dtypes are one error line naming both; fp16 is",
    "  refused (under `--fp16`, `--accumulate-allreduce-grads-in-fp32` chooses).",
    "- `--logging-level N`: the level of Python's root logger (Megatron's meaning).",
    "- `--profile-ranks`: only these ranks profile (empty: all). `--record-memory-history`: on CUDA, each profiled",
    "  rank records the allocator's history from the start of training and dumps it to `--memory-snapshot-path`",
    "  (default snapshot.pickle, the rank in its name) at every log interval; on CPU a line says it is skipped.",
    "",
    "Accepted with a note, each changing nothing that is trained:",
]


def note_lines(notes: dict[str, str]) -> list[str]:
    """The documented notes, a line per flag."""
    return [f"- `--{name}`: {note}." for name, note in notes.items()]


def noted_section() -> list[str]:
    return note_lines(NOTED)
