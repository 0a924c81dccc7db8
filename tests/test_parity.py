"""DESIGN invariant 1: every parallel layout trains the same model as one process.

Each layout runs the tiny fp32 model for STEPS iterations (warmup, then cosine decay to the end)
on the same mock data and must match the one-process run (tests/parity_oracle.py): the loss and
the gradient norm of every iteration and every parameter after the last, to relative 1e-5
(DESIGN's acceptance figure); the parameters come from each run's final checkpoint, in the same
launch (a model-changing override, e.g. an untied head, applies to the reference too). The layouts
cover dp (FSDP, HSDP), tp with and without SP, pp 1F1B with a tied and an untied head, pp 4 (two
middle stages, which read no data), tp x pp without FSDP, each recomputation setting (full uniform,
full block, selective), compile, context parallelism and Megatron's per-token options (document
masking) under dp, tp+SP, pp and cp, and the Llama-style model (LLAMA: grouped-query attention,
SwiGLU, RMSNorm, RoPE, qk-layernorm, no biases, an untied head) on dp, tp+SP, pp, cp, pp x dp x tp
and compiled under dp, and with one key/value group for two tp ranks, and a tiny MoE (MOE) on dp,
tp+SP with a shared expert, pp with recomputation and the expert bias, and expert parallelism
(ep2 and ep4, beside FSDP, pp, tp + SP and cp), and Megatron's --decoupled-lr (the embedding and
output layer at their own LR) on pp2 with the tied head on the other stage and on FSDP (dp2), and
Megatron's --optimizer sgd (momentum 0.8) on dp_shard2 x tp2, and --optimizer muon (Nesterov) on
the Llama-style model at dp_shard2 x tp2 + SP and at pp2, and on the MoE with SwiGLU experts at
ep2 x efsdp2, and gpt-oss's attention and MLP (learned sinks, sliding windows, the clamped SwiGLU)
with Llama 4's qk L2 norm and NoPE blocks on cp2 x tp2 + SP with selective recomputation.
Every other pipeline schedule runs SHORT
iterations, compared
with the start of the same reference: the LR schedule is pinned to STEPS iterations
(lr_decay_iters), so a shorter run is a prefix of the longer one (the reference also saves its
parameters after SHORT iterations). configs/debug_3d.toml itself (8 ranks) runs SHORT iterations
against the same file on one process.

The runs share launches: every layout of the same rank count (and the one-process references)
runs in one launch, one after another through train.py's own entry (tests/runs.py train_runs),
which pays the processes' start-up once per rank count instead of once per layout.

`make test` runs every one; `make test-fast` (the edit loop) keeps one launch that combines three
kinds of parallelism, configs/debug_3d.toml (pp2 x dp2 x tp2 + SP), and skips the rest (marked slow).

Dropout 0.1 (hidden and attention) with model.dropout_rng='layout_invariant' runs on tp2 + SP,
pp2, dp2 and cp2, two of them with recomputation (which must redraw the forward's masks): each
mask element is a function of what it drops, so every layout trains the same model.

Megatron's recompute_modules (selective): [mlp, layernorm] on tp2 + SP and on pp2 zero bubble
(with dropout), [moe] on ep2, [moe_act, layernorm] on ep2 x tp2 + SP (MLA's in
tests/test_parity_deepseek.py).
"""

import hashlib

import pytest

from tests.parity_oracle import assert_same_training
from tests.runs import REPO, Run, result_of, selected_cases, train_runs

STEPS = 4
SHORT = 3
# what every run of the comparison shares; its checkpoints are read for the model only (tests/runs.py
# read_run), so they leave out the optimizer's state: two thirds of what each save writes. A global
# batch of 4 (TINY's is 8) still gives every dp2 rank 2 micro-batches to accumulate and every
# pipeline at least as many micro-batches as stages, at half the micro-batches per iteration.
GLOBAL_BATCH = 4
RUN = [f"--training.train_iters={STEPS}", f"--optimizer.lr_decay_iters={STEPS}", "--checkpoint.save_optimizer=false",
       f"--training.global_batch_size={GLOBAL_BATCH}"]  # fmt: skip

UNTIED = "--model.untie_embeddings_and_output_weights=true"
PP2 = "--parallel.pipeline_model_parallel_size=2"
VPP2 = "--parallel.virtual_pipeline_stages_per_rank=2"
FULL = ["--training.recompute_granularity=full"]  # Megatron's full recomputation; the method follows
CP2 = "--parallel.context_parallel_size=2"
# Megatron's per-token options, all on (eod_mask_loss, reset_position_ids, reset_attention_mask).
DOCS = ["--data.eod_mask_loss=true", "--data.reset_position_ids=true", "--data.reset_attention_mask=true"]
ROPE = "--model.position_embedding_type=rope"
DROPOUT = ["--model.hidden_dropout=0.1", "--model.attention_dropout=0.1", "--model.dropout_rng=layout_invariant"]
# Llama-style: RMSNorm, SwiGLU, 2 key/value groups for 4 heads, no biases, RoPE, qk-layernorm, untied head
LLAMA = ["--model.normalization=RMSNorm", "--model.swiglu=true", "--model.add_bias_linear=false", "--model.group_query_attention=true",
         "--model.num_query_groups=2", ROPE, "--model.qk_layernorm=true", UNTIED]  # fmt: skip
# multi-query: the Llama-style model with one key/value group (and no qk-layernorm, which needs whole groups per rank)
MQA = [*(o for o in LLAMA if "num_query_groups" not in o and "qk_layernorm" not in o), "--model.num_query_groups=1"]
# a tiny MoE (4 experts, top-2, dropless) with both router losses in every block
MOE = ["--model.num_experts=4", "--model.moe_router_topk=2", "--model.moe_ffn_hidden_size=64",
       "--model.moe_aux_loss_coeff=1e-2", "--model.moe_z_loss_coeff=1e-3"]  # fmt: skip
MOE_GROUPED = [*MOE, "--model.moe_grouped_gemm=true"]
SHARED_GATED = ["--model.moe_shared_expert_intermediate_size=64", "--model.moe_shared_expert_gate=true",
                "--model.moe_per_layer_logging=true"]  # fmt: skip
# aux-loss-free balancing: a sigmoid router whose expert bias moves by every iteration's counts
EXPERT_BIAS = ["--model.moe_router_score_function=sigmoid", "--model.moe_router_enable_expert_bias=true", "--model.moe_router_bias_update_rate=0.05"]
DP_SHARD2 = "--parallel.data_parallel_shard_size=2"
TP2_SP = ["--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]


def selective(*modules: str) -> list[str]:
    """Selective recomputation of Megatron's recompute_modules (dtgpt/parallel/recompute_modules.py)."""
    return ["--training.recompute_granularity=selective", f"--training.recompute_modules={list(modules)}"]


def ep(size: int) -> str:
    return f"--parallel.expert_model_parallel_size={size}"

# Megatron's --decoupled-lr and --decoupled-min-lr as a launch script spells them: the word
# embedding and the output layer at their own LR bounds (dtgpt/decoupled_lr.py)
DECOUPLED = ["--decoupled-lr=1e-2", "--decoupled-min-lr=1e-3"]

# Megatron's --optimizer sgd with its momentum, as a launch script spells them (dtgpt/optim.py)
SGD = ["--optimizer=sgd", "--sgd-momentum=0.8"]

# Megatron's --optimizer muon with Nesterov, its Newton-Schulz iteration in fp32 (the default,
# bf16, rounds the layouts' fp32 gradient differences up to bf16's): dtgpt/muon.py
MUON = ["--optimizer=muon", "--muon-nesterov", "--muon-fp32-matmul-prec=high"]

# gpt-oss's attention and MLP as its launch script spells them (a 5-token sliding window in every
# other block from 1, learned attention sinks, the clamped SwiGLU with fc1 offset by 1) on the
# Llama-style model with Llama 4's weightless qk norm and NoPE blocks (RoPE skipped in blocks 2 and 4)
GPT_OSS = [*(o for o in LLAMA if "qk_layernorm" not in o), "--window-size=5,0", "--window-attn-skip-freq=2",
           "--softmax-type=learnable", "--glu-linear-offset=1.0", "--activation-func-clamp-value=0.5", "--qk-l2-norm",
           "--no-rope-freq=2"]  # fmt: skip

# overrides that change the model or what it trains on: the reference gets them too
MODEL_KEYS = ("--model.", "--data.eod_mask_loss", "--data.reset_", "--decoupled-", "--optimizer=", "--sgd-momentum", "--muon-",
              "--window-", "--softmax-type", "--glu-linear-offset", "--activation-func-clamp-value", "--qk-l2-norm", "--no-rope-freq")  # fmt: skip

LAYOUTS = {
    # name: (ranks, overrides)
    "dp_shard2": (2, ["--parallel.data_parallel_shard_size=2"]),
    # one micro-batch per rank (above: 2, accumulated without gradient sync until the last)
    "dp_shard2_one_micro": (2, ["--parallel.data_parallel_shard_size=2", f"--training.micro_batch_size={GLOBAL_BATCH // 2}"]),
    # ZeRO-3 resharding: parameters re-gathered every micro-batch, gradients still reduced once
    "llama_dp_shard2_reshard_always": (2, [*LLAMA, "--parallel.data_parallel_shard_size=2", "--parallel.fsdp_reshard_after_forward=always"]),
    "tp2_sp": (2, ["--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]),
    "pp2_1f1b_tied": (2, ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B"]),
    # Megatron's layout string: stage 0 holds only the embedding, stage 1 the 4 blocks and the tied head
    "pp2_megatron_layout_embedding_alone": (2, [PP2, "--parallel.pipeline_schedule=1F1B", "--pipeline-model-parallel-layout=E|t*4L"]),
    # stages 1 and 2 hold neither the first nor the last stage: they read no batches
    "pp4_middle_stages": (4, ["--parallel.pipeline_model_parallel_size=4", "--parallel.pipeline_schedule=1F1B"]),
    # full recomputation, 'uniform' in groups of 2 of the 4 blocks
    "dp2_tp2_full_uniform_ac": (
        4,
        ["--parallel.tensor_model_parallel_size=2", "--parallel.data_parallel_shard_size=2", *FULL, "--training.recompute_method=uniform", "--training.recompute_num_layers=2"],
    ),
    # full recomputation, 'block': the first block of each stage
    "pp2_full_block_ac": (
        2,
        ["--parallel.pipeline_model_parallel_size=2", *FULL, "--training.recompute_method=block", "--training.recompute_num_layers=1"],
    ),
    # the 175B shape: tp x pp with dp = 1 (no FSDP), tied embedding split across stages
    "pp2_tp2_sp_dp1": (
        4,
        ["--parallel.pipeline_model_parallel_size=2", "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"],
    ),
    # torch.compile: whole model on one rank, per block under FSDP (tp/pp with compile are refused)
    "compile_single": (1, ["--training.compile=true"]),
    "llama_compile_dp2_per_block": (2, [*LLAMA, "--training.compile=true", "--parallel.data_parallel_shard_size=2"]),
    # documents: loss masked at eods, positions reset, attention within each document (mock
    # data with vocabulary 128 holds an eod every 128 tokens). pp2 with RoPE: both stages need
    # the positions and document ids, which the schedule hands every stage as keyword arguments.
    "docs_dp_shard2": (2, [*DOCS, "--parallel.data_parallel_shard_size=2"]),
    "docs_tp2_sp": (2, [*DOCS, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]),
    "docs_pp2_rope": (2, [*DOCS, ROPE, "--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B"]),
    # the documents' positions and ids cut with the sequence: each cp rank masks its chunks' tokens
    "docs_cp2_rope": (2, [*DOCS, ROPE, CP2]),
    "dp_shard4": (4, ["--parallel.data_parallel_shard_size=4"]),
    "hsdp_2x2": (4, ["--parallel.data_parallel_replicate_size=2", "--parallel.data_parallel_shard_size=2"]),
    # whole key/value groups per tp rank; the qk-norms' weights see only their rank's heads
    "llama_tp2_sp": (2, [*LLAMA, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]),
    # one key/value group for 2 tp ranks (multi-query): both take it from the gathered QKV output
    "mqa_tp2_sp": (2, [*MQA, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]),
    "tp4": (4, ["--parallel.tensor_model_parallel_size=4"]),
    "llama_pp2_selective_ac": (
        2,
        [*LLAMA, "--parallel.pipeline_model_parallel_size=2", "--training.recompute_granularity=selective"],
    ),
    "llama_pp2_dp2_tp2": (
        8,
        [*LLAMA, "--parallel.pipeline_model_parallel_size=2", "--parallel.data_parallel_shard_size=2", "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"],
    ),
    # context parallelism: each rank holds 2 of 4 sequence chunks; full recomputation passes the
    # chunks' positions through its recomputed groups
    "cp2_full_uniform_ac": (2, [CP2, *FULL, "--training.recompute_method=uniform", "--training.recompute_num_layers=2"]),
    "cp2_tp2_sp": (4, [CP2, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]),
    # every pipeline stage gets its chunks' positions from the schedule (middle ranks read batches)
    "cp2_pp2_1f1b": (4, [CP2, "--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B"]),
    "cp2_dp2": (4, [CP2, "--parallel.data_parallel_shard_size=2"]),
    # RoPE at global positions; the recomputed attention core re-gathers keys and values (of 2 groups)
    "llama_cp2_selective_ac": (2, [*LLAMA, CP2, "--training.recompute_granularity=selective"]),
    # layout-invariant dropout: the same masks on every layout (tp ranks' heads and sequence
    # chunks, pipeline micro-batches, dp ranks' samples, cp ranks' chunks and gathered keys);
    # recomputed blocks (pp2) and attention cores (cp2) redraw the masks of their forward
    "dropout_tp2_sp": (2, [*DROPOUT, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]),
    "dropout_pp2_full_block_ac": (
        2,
        [*DROPOUT, "--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B", *FULL, "--training.recompute_method=block", "--training.recompute_num_layers=1"],
    ),
    "dropout_dp_shard2": (2, [*DROPOUT, "--parallel.data_parallel_shard_size=2"]),
    "dropout_cp2_selective_ac": (2, [*DROPOUT, CP2, "--training.recompute_granularity=selective"]),
    # Megatron's recompute_modules: the MLP checkpointed (its input gathered by SP) and the norms'
    # outputs discarded until backward (kept under SP, where they are DTensor chunks)
    "dropout_tp2_sp_recompute_mlp_layernorm": (2, [*DROPOUT, *TP2_SP, *selective("mlp", "layernorm")]),
    # every stage one block; zero bubble splits backward into the inputs' gradients, which refill
    # the discarded norm outputs, and the weights' later, which read them (and rerun the MLP)
    "dropout_pp2_zero_bubble_recompute_layernorm_mlp": (
        2,
        [*DROPOUT, PP2, VPP2, "--parallel.pipeline_schedule=InterleavedZeroBubble", *selective("layernorm", "mlp")],
    ),
    # MoE: FSDP shards the stacked experts; tp ranks route their own sequence chunks with
    # replicated router and experts (a tensor-parallel shared expert beside them); pp with
    # recomputed blocks and aux-loss-free balancing, whose bias moves by every iteration's counts
    # (counting the pipeline's metadata-inference forward would change them). Router losses,
    # tokens per expert and dropped tokens are compared too (tests/parity_oracle.py).
    # The shared expert is gated (Megatron's moe_shared_expert_gate): the gate's one row is
    # replicated over tp like the router, its gradient summed over the tp ranks' chunks; the
    # router losses are also logged per layer (moe_per_layer_logging), compared with one process.
    "moe_dp_shard2": (2, [*MOE, "--parallel.data_parallel_shard_size=2"]),
    "moe_tp2_sp_shared_expert": (
        2,
        [*MOE, *SHARED_GATED, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"],
    ),
    # dp x tp: the router and experts FSDP-sharded over all 4 ranks (tp folded in, as Megatron's
    # expert-data-parallel group), their gradients summed in one reduce-scatter per MoE layer
    "moe_dp_shard2_tp2_sp_shared_expert": (
        4,
        [*MOE, *SHARED_GATED, DP_SHARD2, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"],
    ),
    "moe_pp2_expert_bias_full_block_ac": (
        2,
        [*MOE, *EXPERT_BIAS, "--model.moe_layer_freq=2", PP2, "--parallel.pipeline_schedule=1F1B",
         *FULL, "--training.recompute_method=block", "--training.recompute_num_layers=1"],
    ),  # fmt: skip
    # expert parallelism (grouped GEMM): ep folded out of dp_shard x cp, tokens sent to their
    # experts' ranks by all-to-all; with 2 ranks left for the experts' FSDP (ep2 of dp_shard 4),
    # under a pipeline, beside tp + SP with the expert bias (each tp rank's chunk goes to its own ep
    # group; the bias stays a plain buffer) and on the
    # ranks of cp2. The experts are saved whole (E, ...) whatever ep is.
    "moe_ep2": (2, [*MOE_GROUPED, DP_SHARD2, ep(2)]),
    "moe_ep4": (4, [*MOE_GROUPED, "--parallel.data_parallel_shard_size=4", ep(4)]),
    "moe_ep2_dp_shard4": (4, [*MOE_GROUPED, "--parallel.data_parallel_shard_size=4", ep(2)]),
    "moe_ep2_pp2": (4, [*MOE_GROUPED, PP2, "--parallel.pipeline_schedule=1F1B", ep(2)]),
    "moe_ep2_tp2_sp_expert_bias": (
        4,
        [*MOE_GROUPED, *EXPERT_BIAS, DP_SHARD2, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true", ep(2)],
    ),
    "moe_ep2_cp2": (2, [*MOE_GROUPED, CP2, ep(2)]),
    # recompute_modules under ep: the whole MoE layer (its recomputed forward exchanges its tokens
    # again), and the experts' activation discarded until backward beside tp + SP
    "moe_ep2_recompute_moe": (2, [*MOE_GROUPED, DP_SHARD2, ep(2), *selective("moe")]),
    "moe_ep2_tp2_sp_recompute_moe_act_layernorm": (4, [*MOE_GROUPED, DP_SHARD2, *TP2_SP, ep(2), *selective("moe_act", "layernorm")]),
    # Megatron's forced load balancing (a benchmarking mode): the router's logits replaced by draws
    # keyed on each token's index in the run, so tp + SP chunks, cp chunks and ep ranks draw what
    # one process draws for the same tokens (with group-limited top-k over the draws)
    "moe_ep2_tp2_sp_cp2_forced_balance": (
        4,
        [*MOE_GROUPED, "--model.moe_router_force_load_balancing=true", "--model.moe_router_num_groups=2",
         "--model.moe_router_group_topk=1", "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true", CP2, ep(2)],
    ),  # fmt: skip
    # a capacity factor: each expert takes at most 1.0 x its share of a micro-batch's tokens,
    # counted per micro-batch, which no dp, ep or pp split changes (tp and cp, which split a
    # sequence, are refused): the same tokens drop on every layout (dropped_tokens compared). Padded to
    # capacity (Megatron's static-shape mode): every exchange's sizes are known, nothing syncs.
    # decoupled LR: the tied embedding on stage 0 and its copy, the head, on stage 1 must move at
    # the same LR to stay one weight; under FSDP the embedding is a DTensor shard of the root unit
    "decoupled_lr_pp2_1f1b_tied": (2, [*DECOUPLED, PP2, "--parallel.pipeline_schedule=1F1B"]),
    "decoupled_lr_dp_shard2": (2, [*DECOUPLED, DP_SHARD2]),
    # SGD's momentum buffers as DTensor shards of FSDP2 over tp
    "sgd_dp_shard2_tp2": (4, [*SGD, DP_SHARD2, "--parallel.tensor_model_parallel_size=2"]),
    # Muon on the Llama-style model: each matrix's update gathered whole (FSDP2 and TP shards, the
    # QKV split per query group, SwiGLU's gate and fc1 as one), orthogonalised, its shard kept
    "muon_llama_dp_shard2_tp2_sp": (4, [*MUON, *LLAMA, DP_SHARD2, *TP2_SP]),
    "muon_llama_pp2_1f1b": (2, [*MUON, *LLAMA, PP2, "--parallel.pipeline_schedule=1F1B"]),
    # Muon on each expert's matrix (SwiGLU's [gate; fc1] one): experts whole over ep, each expert's
    # rows split over efsdp 2, each expert's matrix orthogonalised by its owner among them. (ep2 x
    # tp2 + SP, whose router has an FSDP unit of its own and whose experts' owners span efsdp x tp,
    # costs 30 s more here: it runs in tests/test_moe_resume.py; its collectives are counted in
    # tests/test_comm_counts.py.)
    "muon_moe_ep2_dp_shard4": (4, [*MUON, *MOE_GROUPED, "--model.swiglu=true", "--parallel.data_parallel_shard_size=4", ep(2)]),
    # the sinks' logits split by head over tp, the recomputed core handed this rank's; windows cut
    # across the cp chunks in global positions, sinks over the gathered keys
    "gpt_oss_cp2_tp2_sp_selective_ac": (4, [*GPT_OSS, CP2, *TP2_SP, "--training.recompute_granularity=selective"]),
    "moe_ep2_capacity_pp2": (4, [*MOE_GROUPED, "--model.moe_expert_capacity_factor=1.0", "--model.moe_pad_expert_input_to_capacity=true", DP_SHARD2, PP2, "--parallel.pipeline_schedule=1F1B", ep(2)]),
}


# What a layout's run prints that shows its split took effect
# (rank 0's parameters: the embedding alone, (128 words + 32 positions) x 64)
PRINTED = {"pp2_megatron_layout_embedding_alone": "schedule 1F1B, blocks per stage 0 4\n> model: 10,240 parameters on rank 0"}

SCHEDULES = {
    # every schedule besides 1F1B (above), on 2 ranks for SHORT iterations
    "GPipe": [PP2],
    "Interleaved1F1B": [PP2, VPP2],
    "LoopedBFS": [PP2, VPP2],
    "InterleavedZeroBubble": [PP2, VPP2],
    "ZBVZeroBubble": [PP2, VPP2],
    "DualPipeV": [PP2, VPP2],
}


def model_overrides(overrides: list[str]) -> list[str]:
    return [o for o in overrides if o.startswith(MODEL_KEYS)]


def reference_key(model_args: list[str]) -> str:
    """The name of the one-process run of a model variant (tied by default, untied, ...)."""
    return "single_" + hashlib.sha1(" ".join(model_args).encode()).hexdigest()[:10]


def schedule_overrides(schedule: str) -> list[str]:
    return [*SCHEDULES[schedule], f"--parallel.pipeline_schedule={schedule}", f"--training.train_iters={SHORT}"]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """Every selected layout and schedule, with the one-process run of each model variant they
    need (which saves its parameters after SHORT and STEPS iterations), launched together: one
    launch per rank count (tests/runs.py train_runs)."""
    layouts = selected_cases(request, test_layout_matches_single_process)
    schedules = selected_cases(request, test_every_pipeline_schedule_matches_single_process)
    batch = [Run(name, tmp_path_factory.mktemp(name), RUN + LAYOUTS[name][1], LAYOUTS[name][0]) for name in layouts]
    batch += [Run(name, tmp_path_factory.mktemp(name), RUN + schedule_overrides(name), 2) for name in schedules]
    variants = {tuple(model_overrides(LAYOUTS[name][1])) for name in layouts} | ({()} if schedules else set())
    if selected_cases(request, test_decoupled_lr_changes_what_is_trained):
        variants |= {(), tuple(DECOUPLED)}
    if selected_cases(request, test_sgd_changes_what_is_trained):
        variants |= {(), tuple(SGD)}
    if selected_cases(request, test_muon_changes_what_is_trained):
        variants |= {tuple(LLAMA), tuple(MUON + LLAMA)}
    for model_args in sorted(variants):
        batch.append(Run(reference_key(list(model_args)), tmp_path_factory.mktemp("single"), RUN + list(model_args), save_interval=SHORT))
    if selected_cases(request, test_debug_3d_config_matches_single_process):
        debug_3d = tmp_path_factory.mktemp("debug_3d")
        batch += [Run("debug_3d_single", debug_3d, DEBUG_3D + ONE_PROCESS, base=[]), Run("debug_3d", debug_3d, DEBUG_3D, 8, base=[])]
    return train_runs(batch)


def reference(runs: dict, model_args: list[str]) -> dict:
    run = result_of(runs, reference_key(model_args))
    assert len(run["loss"]) == STEPS and run["loss"][-1] < run["loss"][0]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(runs, name):
    expected = reference(runs, model_overrides(LAYOUTS[name][1]))
    assert_same_training(result_of(runs, name), expected, STEPS)
    assert PRINTED.get(name, "") in result_of(runs, name)["output"]


@pytest.mark.slow
def test_decoupled_lr_changes_what_is_trained(runs):
    """The flags reach the optimizer through train.py: the one-process runs with and without them
    start alike and part once the embedding moves at its own LR."""
    plain, decoupled = reference(runs, []), reference(runs, DECOUPLED)
    assert decoupled["loss"][0] == plain["loss"][0] and decoupled["loss"][-1] != pytest.approx(plain["loss"][-1], rel=1e-4)


@pytest.mark.slow
def test_sgd_changes_what_is_trained(runs):
    """--optimizer sgd reaches the optimizer through train.py: the one-process runs with Adam and
    with SGD take the same first iteration (at the warmup's LR 0) and part after it."""
    adam, sgd = reference(runs, []), reference(runs, SGD)
    assert sgd["loss"][0] == adam["loss"][0] and sgd["loss"][-1] != pytest.approx(adam["loss"][-1], rel=1e-4)


@pytest.mark.slow
def test_muon_changes_what_is_trained(runs):
    """--optimizer muon reaches the optimizer through train.py: the one-process runs of the
    Llama-style model with AdamW and with Muon start alike and part after the first step."""
    adam, muon = reference(runs, LLAMA), reference(runs, MUON + LLAMA)
    assert muon["loss"][0] == adam["loss"][0] and muon["loss"][-1] != pytest.approx(adam["loss"][-1], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_pipeline_schedule_matches_single_process(runs, name):
    assert_same_training(result_of(runs, name), reference(runs, []), SHORT)


DEBUG_3D = ["--config", str(REPO / "configs/debug_3d.toml"), f"--training.train_iters={SHORT}", "--eval.eval_iters=0"]
ONE_PROCESS = ["--parallel.tensor_model_parallel_size=1", "--parallel.pipeline_model_parallel_size=1", "--parallel.sequence_parallel=false"]


def test_debug_3d_config_matches_single_process(runs):
    """configs/debug_3d.toml as the README runs it (pp2 x dp2 x tp2 + SP, 8 ranks) against the same
    file on one process (both in the module's launches: the 8 ranks share the 8-rank layouts' one)."""
    assert_same_training(result_of(runs, "debug_3d"), result_of(runs, "debug_3d_single"), SHORT)
