"""DESIGN invariant 1 for multi-latent attention (dtgpt/mla.py): a tiny MLA GPT (compressed query,
norms on the compressed vectors, YaRN) trains on tp2 + SP with selective recomputation, pp2 with full
recomputation, and cp2 (FSDP over the cp ranks) exactly as on one process: the loss and the
gradient norm of every iteration and every parameter after the last (tests/parity_oracle.py,
relative 1e-5). The runs share one launch per rank count (tests/runs.py train_runs)."""

import pytest

from tests.parity_oracle import assert_same_training
from tests.runs import Run, result_of, selected_cases, train_runs

STEPS = 5
RUN = [f"--training.train_iters={STEPS}", f"--optimizer.lr_decay_iters={STEPS}"]
# 4 heads; the query compressed to 32, keys/values to 16; 16 + 8 query/key channels per head, 12 value channels
MLA = ["--model.multi_latent_attention=true", "--model.position_embedding_type=rope", "--model.q_lora_rank=32",
       "--model.kv_lora_rank=16", "--model.qk_head_dim=16", "--model.qk_pos_emb_head_dim=8", "--model.v_head_dim=12",
       "--model.qk_layernorm=true", "--model.normalization=RMSNorm", "--model.rotary_scaling_factor=40",
       "--model.mscale=1.0", "--model.mscale_all_dim=1.0", "--model.original_max_position_embeddings=16"]  # fmt: skip
TP2 = "--parallel.tensor_model_parallel_size=2"
LAYOUTS = {
    "tp2_sp_selective": (2, [TP2, "--parallel.sequence_parallel=true", "--training.recompute_granularity=selective"]),
    "pp2_full_recompute": (2, ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B",
                               "--training.recompute_granularity=full", "--training.recompute_method=uniform",
                               "--training.recompute_num_layers=1"]),
    "cp2": (2, ["--parallel.context_parallel_size=2"]),  # FSDP shards over the cp ranks too
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    names = selected_cases(request, test_mla_layout_matches_single_process)
    batch = [Run(n, tmp_path_factory.mktemp(n), RUN + MLA + LAYOUTS[n][1], LAYOUTS[n][0]) for n in names]
    batch.append(Run("single", tmp_path_factory.mktemp("single"), RUN + MLA))
    return train_runs(batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mla_layout_matches_single_process(runs, name):
    expected = result_of(runs, "single")
    assert expected["loss"][-1] < expected["loss"][0]
    assert_same_training(result_of(runs, name), expected, STEPS)
