"""DESIGN invariant 1 for a tiny DeepSeek-style GPT given as Megatron-LM flags (DEEPSEEK):
multi-latent attention (compressed query, norms, YaRN), one dense block then three MoE blocks of
8 fine-grained experts and a shared one, sigmoid routing with the expert bias, group-limited to
2 of 4 groups, the weights scaled by 2.5, and one multi-token prediction module (logged as
`mtp_1 loss`, compared too). It trains as on one process on tp2 + SP x ep2
(configs/deepseek_v3_twin.toml itself at a global batch of 4, whose model is this one), on pp2 with full recomputation,
and on cp2 (FSDP over the cp ranks; the prediction module's shifted tokens and labels cross the
cp chunks) with selective recomputation; and the attention alone with its query projected in one, on tp2 without sequence
parallelism (also under Megatron's Muon) and on tp2 + SP with 2 sequences per micro-batch: the loss, the gradient norm
and the router's loss of every iteration, the tokens per expert, and every parameter after the
last (tests/parity_oracle.py, relative 1e-5). Its checkpoints are mesh-free: the pp2 run's of
iteration 3 continues on tp2 + SP x ep2 as the one-process run does. One launch per rank count
(tests/runs.py)."""

import pytest

from dtgpt.config import load_config
from tests.parity_oracle import assert_same_training
from tests.runs import REPO, SECONDS_PER_RUN, TINY, Run, result_of, selected_cases, train_runs

STEPS = 5
# a global batch of 4 (the twin's and TINY's 8): every layout still accumulates 2 micro-batches or more per rank
RUN = [f"--training.train_iters={STEPS}", f"--optimizer.lr_decay_iters={STEPS}", "--training.global_batch_size=4"]
TWIN = str(REPO / "configs" / "deepseek_v3_twin.toml")
DEEPSEEK = [
    "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm", "--rope-type", "yarn",
    "--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
    "--num-experts", "8", "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "4", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05", "--moe-router-num-groups", "4",
    "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
    "--calculate-per-token-loss",  # as DeepSeek-V3's Megatron scripts pass it (a launch script's default is Megatron's false)
]  # fmt: skip
# with one multi-token prediction module (an MoE block, the last block's kind), on the last stage
DEEPSEEK_MTP = DEEPSEEK + ["--mtp-num-layers", "1"]
# the attention alone, its query projected in one (no q_lora_rank), on tp 2 with and without SP (MoE needs SP)
DENSE_MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
             "--v-head-dim", "12", "--position-embedding-type", "rope", "--rotary-scaling-factor", "40",
             "--mscale-all-dim", "1.0"]  # fmt: skip
TP2 = ["--parallel.tensor_model_parallel_size=2"]
# with Megatron's Muon (Nesterov, its Newton-Schulz iteration in fp32, as tests/test_parity.py's)
MUON_DENSE_MLA = DENSE_MLA + ["--optimizer=muon", "--muon-nesterov", "--muon-fp32-matmul-prec=high"]


def selective(*modules: str) -> list[str]:
    return ["--recompute-granularity", "selective", "--recompute-modules", *modules]  # as a launch script spells it


LAYOUTS = {
    "twin_tp2_sp_ep2": (4, ["--config", TWIN], []),
    "pp2_full_recompute": (2, DEEPSEEK_MTP + ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B",
                                          "--training.recompute_granularity=full", "--training.recompute_method=uniform",
                                          "--training.recompute_num_layers=1"], TINY),
    # selective recomputation of the attention core (cp's, which gathers keys and values) and of
    # Megatron's recompute_modules beside it: the up-projections and RoPE run keeping only their
    # inputs, q, k, v, the norms' outputs and the experts' activation discarded until backward,
    # the shared expert checkpointed
    "cp2_selective_up_proj_shared_moe_act_layernorm": (
        2, DEEPSEEK_MTP + ["--parallel.context_parallel_size=2"]
        + selective("core_attn", "mla_up_proj", "shared_experts", "moe_act", "layernorm"), TINY,
    ),
    "dense_mla_tp2": (2, DENSE_MLA + TP2, TINY),
    # Megatron's Muon on the latent attention's projections, their rows and columns split over tp
    "muon_dense_mla_tp2": (2, MUON_DENSE_MLA + TP2, TINY),
    # the same modules on tp ranks' heads (no SP: the norms' outputs are plain tensors, released)
    "dense_mla_tp2_recompute_up_proj_layernorm": (2, DENSE_MLA + TP2 + selective("mla_up_proj", "layernorm"), TINY),
    "dense_mla_dp2_up_proj": (2, DENSE_MLA + selective("mla_up_proj"), TINY),
    # SP with 2 sequences per micro-batch: the down-projection's (batch, sequence-chunk) input,
    # which torch 2.11's DTensor could not flatten for a linear layer (dtgpt/parallel/tensor_mla.py)
    "dense_mla_tp2_sp_mb2": (2, DENSE_MLA + TP2 + ["--parallel.sequence_parallel=true", "--training.micro_batch_size=2"], TINY),
    # the pp2 run's checkpoint of iteration 3 (two stages, the prediction module on the last with
    # its copy of the embedding) loaded on tp2 + SP x ep2, which trains iterations 4 and 5
    "twin_from_pp2_at_3": (4, ["--config", TWIN], []),
}  # fmt: skip
# a layout that starts from another's checkpoint: (the run that saved it, its iteration)
RESUMES = {"twin_from_pp2_at_3": ("pp2_full_recompute", 3)}
REFERENCE = {name: MUON_DENSE_MLA if name.startswith("muon") else DENSE_MLA if name.startswith("dense") else DEEPSEEK_MTP for name in LAYOUTS}
SINGLE = {"single": DEEPSEEK_MTP, "single_dense": DENSE_MLA, "single_muon_dense": MUON_DENSE_MLA}


def test_twin_is_the_flags_model():
    """configs/deepseek_v3_twin.toml trains the model the flags describe, on the same data and schedule."""
    twin, flags = load_config(TWIN), load_config(None, TINY + DEEPSEEK_MTP)
    for section in ("model", "data", "optimizer"):
        assert getattr(twin, section) == getattr(flags, section), section
    assert (twin.training.micro_batch_size, twin.training.global_batch_size) == (1, 8)
    assert twin.training.calculate_per_token_loss == flags.training.calculate_per_token_loss  # the MTP term's divisor
    big = load_config(str(REPO / "configs" / "deepseek_v3.toml")).model
    same = ("multi_latent_attention", "qk_layernorm", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
            "normalization", "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights",
            "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
            "moe_router_load_balancing_type", "moe_grouped_gemm", "mtp_num_layers", "mtp_loss_scaling_factor")  # fmt: skip
    assert {k: getattr(twin.model, k) for k in same} == {k: getattr(big, k) for k in same}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    selected = selected_cases(request, test_deepseek_layout_matches_single_process)
    names = list(dict.fromkeys([RESUMES[n][0] for n in selected if n in RESUMES] + selected))  # savers first
    saves = {source: iteration for name, (source, iteration) in RESUMES.items() if name in names}
    directories = {n: tmp_path_factory.mktemp(n) for n in names}
    batch = []
    for n in names:
        nproc, args, base = LAYOUTS[n]
        if n in RESUMES:
            source, iteration = RESUMES[n]
            args = args + [f"--checkpoint.load={directories[source] / f'{source}_ckpt'}", f"--checkpoint.load_iteration={iteration}"]
        # A 4-rank MoE + MLA run on 2 heavily loaded cores has taken over 2 minutes (start-up included):
        # 3 x the default bound per run (a hung run stops at the collective timeout anyway).
        batch.append(Run(n, directories[n], args + RUN, nproc, base=base, save_interval=saves.get(n, 0),
                         seconds=3 * SECONDS_PER_RUN if nproc > 2 else 0.0))  # fmt: skip
    for key, model in SINGLE.items():
        if any(REFERENCE[n] is model for n in names):
            batch.append(Run(key, tmp_path_factory.mktemp(key), model + RUN))
    return train_runs(batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_layout_matches_single_process(runs, name):
    expected = result_of(runs, next(key for key, model in SINGLE.items() if model is REFERENCE[name]))
    assert expected["loss"][-1] < expected["loss"][0]
    if REFERENCE[name] is DEEPSEEK_MTP:  # the prediction module's block routes too
        assert "seq_load_balancing_loss" in expected and len(expected["tokens_per_expert"][0]) == 4
        # logged beside the LM loss, and learning
        assert "mtp_1 loss" in expected and expected["mtp_1 loss"][-1] < expected["mtp_1 loss"][0]
    assert_same_training(result_of(runs, name), expected, STEPS, resumed_at=RESUMES.get(name, ("", 0))[1])
