"""An MoE model's checkpoints are mesh-free under expert parallelism (DESIGN invariant 3); its
layouts train the one-process model (invariant 1) in tests/test_parity.py (moe_ep*).

The tiny fp32 GPT of tests/runs.py with every block's MLP an MoE layer: dropless top-2 over 4
experts (grouped GEMM, the load-balancing loss on). A run saved at ep2 x tp2 + SP (4 ranks: the
experts split over ep, FSDP-sharded over the ranks left times tp, the routers over all 4, tp
folded in) resumes at ep1 on one process, and one saved at ep1 resumes at ep2. Megatron's Muon
(dtgpt/muon.py) on the model with a dense SwiGLU block first: saved at ep2 x tp2 + SP (4 ranks,
tp folded in: each expert's rows FSDP-split over efsdp 1 x tp 2, each expert's matrix owned by one
of them; the dense matrices owned over 2 shard ranks and gathered over tp), resumed at dp_shard2
without ep (2 ranks, whole experts each; ep2 x efsdp2 is held to one process in
tests/test_parity.py); its checkpoint holds the momentum of the stacked
experts, of the split QKV and of SwiGLU's [gate; fc1] beside AdamW's moments of the rest. Each
resumed run matches the uninterrupted one as the parity oracle holds a layout to one process
(tests/parity_oracle.py: loss, gradient norm, routing figures each iteration and every final
parameter, to fp32 rounding: the meshes sum in other orders, so not bitwise).
"""

import pytest

from dtgpt.checkpoint import layout
from tests.parity_oracle import assert_same_training
from tests.runs import TINY, Command, launch_commands, read_run, selected_cases

pytestmark = pytest.mark.slow  # torchrun launches

MOE = ["--model.num_experts=4", "--model.moe_router_topk=2", "--model.moe_grouped_gemm=true", "--model.moe_aux_loss_coeff=1e-2"]
ITERS, SAVED = 6, 3


def ep(size: int) -> str:
    return f"--parallel.expert_model_parallel_size={size}"


# the expert bias on: it is state a resume must restore (its Adam-free updates come from the counts)
EXPERT_BIAS = ["--model.moe_router_score_function=sigmoid", "--model.moe_router_enable_expert_bias=true", "--model.moe_router_bias_update_rate=0.05"]
# TINY's batch of 8 in micro-batches of 2: 4 a step on one process, 2 on each of 2 data-parallel ranks
RESUME = [*TINY, *MOE, *EXPERT_BIAS, f"--training.train_iters={ITERS}", f"--optimizer.lr_decay_iters={ITERS}",
          "--training.micro_batch_size=2"]  # fmt: skip
# Muon with Nesterov, its iteration in fp32 (bf16's would round the meshes' fp32 differences up);
# block 0 dense (SwiGLU's gate and fc1: one matrix), the experts SwiGLU too
MUON = ["--optimizer=muon", "--muon-nesterov", "--muon-fp32-matmul-prec=high", "--model.swiglu=true", "--model.moe_layer_freq=[0,1,1,1]"]


def command(directory, key: str, args: list[str], nproc: int) -> Command:
    """A run saving into KEY_ckpt at SAVED and ITERS, its metrics in KEY.jsonl (tests/runs.py read_run)."""
    ckpt = [f"--checkpoint.save={directory / f'{key}_ckpt'}", f"--checkpoint.save_interval={SAVED}"]
    return Command(key, directory, RESUME + args + ckpt + [f"--logging.metrics_file={directory / f'{key}.jsonl'}"], nproc)


LAYOUT_EP2 = ["--parallel.data_parallel_shard_size=2", ep(2)]
LAYOUTS = {
    "ep1": ([], 1),
    "ep2": (LAYOUT_EP2, 2),
    "ep2_tp2_sp": ([*LAYOUT_EP2, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"], 4),
    "muon_ep2_tp2_sp": ([*MUON, *LAYOUT_EP2, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"], 4),
    "muon_dp_shard2": ([*MUON, "--parallel.data_parallel_shard_size=2"], 2),
}
CASES = {  # case: (saved at, resumed at)
    "ep2_tp2_sp_to_ep1": ("ep2_tp2_sp", "ep1"),
    "ep1_to_ep2": ("ep1", "ep2"),
    "muon_ep2_tp2_sp_to_dp_shard2": ("muon_ep2_tp2_sp", "muon_dp_shard2"),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """Each selected case's whole run, then its resume: one launch per rank count (tests/runs.py
    launch_commands; the one-process launch resumes one case and saves the other's). {key: (Finished, directory)}."""
    commands = []
    for case in selected_cases(request, test_a_checkpoint_resumes_at_another_ep):
        (saved, saved_ranks), (resumed, resumed_ranks) = (LAYOUTS[layout] for layout in CASES[case])
        directory = tmp_path_factory.mktemp(case)
        root = directory / f"{case}_whole_ckpt"
        commands += [command(directory, f"{case}_whole", saved, saved_ranks),
                     command(directory, f"{case}_resumed", resumed + [f"--checkpoint.load={root}", f"--checkpoint.load_iteration={SAVED}"], resumed_ranks)]  # fmt: skip
    finished = launch_commands(sorted(commands, key=lambda c: (4, 1, 2).index(c.nproc))) if commands else {}
    return {c.key: (finished[c.key], c.directory) for c in commands}


def finished_run(runs: dict, key: str) -> dict:
    """read_run's dict of a run that finished; one that failed fails the test with its log."""
    finished, directory = runs[key]
    finished.checked()
    return read_run(directory, key)


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_resumes_at_another_ep(runs, case):
    whole, resumed = finished_run(runs, f"{case}_whole"), finished_run(runs, f"{case}_resumed")
    assert sorted(whole["params"]) == [SAVED, ITERS] and sorted(resumed["params"]) == [ITERS]
    assert_same_training(resumed, whole, ITERS, resumed_at=SAVED)
    if case.startswith("muon"):
        saved = layout.read_metadata(layout.iteration_dir(runs[f"{case}_whole"][1] / f"{case}_whole_ckpt", SAVED)).state_dict_metadata
        momentum = ["layers.1.mlp.experts.fc1_weight", "layers.1.mlp.experts.fc2_weight", "layers.0.attention.qkv.weight",
                    "layers.0.mlp.gate.weight", "layers.0.mlp.fc1.weight", "layers.1.mlp.router.weight"]  # fmt: skip
        moments = ["layers.1.mlp.experts.fc1_bias", "layers.0.mlp.fc1.bias", "norm.weight", "embedding.word.weight"]
        assert {f"optimizer.state.{name}.momentum_buffer" for name in momentum} <= set(saved)
        assert {f"optimizer.state.{name}.{m}" for name in moments for m in ("exp_avg", "exp_avg_sq")} <= set(saved)
        assert not any(k.startswith("optimizer.state.layers.0.attention.qkv.weight.exp_avg") for k in saved)
