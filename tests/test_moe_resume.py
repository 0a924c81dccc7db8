"""An MoE model's checkpoints are mesh-free under expert parallelism (DESIGN invariant 3); its
layouts train the one-process model (invariant 1) in tests/test_parity.py (moe_ep*).

The tiny fp32 GPT of tests/runs.py with every block's MLP an MoE layer: dropless top-2 over 4
experts (grouped GEMM, the load-balancing loss on). A run saved at ep2 x tp2 + SP (4 ranks: the
experts split over ep, FSDP-sharded over the ranks left times tp, the routers over all 4, tp
folded in) resumes at ep1 on one process, and one saved at ep1 resumes at ep2, each equal to the
uninterrupted run to fp32 rounding.
"""

import pytest

from tests.runs import TINY, Command, launch_commands, read_metrics, selected_cases

pytestmark = pytest.mark.slow  # torchrun launches

MOE = ["--model.num_experts=4", "--model.moe_router_topk=2", "--model.moe_grouped_gemm=true", "--model.moe_aux_loss_coeff=1e-2"]


def ep(size: int) -> str:
    return f"--parallel.expert_model_parallel_size={size}"


# the expert bias on: it is state a resume must restore (its Adam-free updates come from the counts)
EXPERT_BIAS = ["--model.moe_router_score_function=sigmoid", "--model.moe_router_enable_expert_bias=true", "--model.moe_router_bias_update_rate=0.05"]
RESUME = [*TINY, *MOE, *EXPERT_BIAS, "--training.train_iters=6", "--optimizer.lr_decay_iters=6"]


def command(directory, key: str, args: list[str], nproc: int) -> Command:
    return Command(key, directory, RESUME + args + [f"--logging.metrics_file={directory / f'{key}.jsonl'}"], nproc)


def losses_of(runs: dict, key: str) -> dict[int, float]:
    """A run's losses by iteration; a run that failed fails the test with its log."""
    finished, directory = runs[key]
    finished.checked()
    return {r["iteration"]: r["loss"] for r in read_metrics(directory / f"{key}.jsonl")}


LAYOUT_EP2 = ["--parallel.data_parallel_shard_size=2", ep(2)]
LAYOUTS = {
    "ep1": ([], 1),
    "ep2": (LAYOUT_EP2, 2),
    "ep2_tp2_sp": ([*LAYOUT_EP2, "--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"], 4),
}
CASES = {"ep2_tp2_sp_to_ep1": ("ep2_tp2_sp", "ep1"), "ep1_to_ep2": ("ep1", "ep2")}  # case: (saved at, resumed at)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """Each selected case's whole run, then its resume: one launch per rank count (tests/runs.py
    launch_commands; the one-process launch resumes one case and saves the other's). {key: (Finished, directory)}."""
    commands = []
    for case in selected_cases(request, test_a_checkpoint_resumes_at_another_ep):
        (saved, saved_ranks), (resumed, resumed_ranks) = (LAYOUTS[layout] for layout in CASES[case])
        directory = tmp_path_factory.mktemp(case)
        root = directory / "ckpt"
        commands += [command(directory, f"{case}_whole", saved + [f"--checkpoint.save={root}", "--checkpoint.save_interval=3"], saved_ranks),
                     command(directory, f"{case}_resumed", resumed + [f"--checkpoint.load={root}", "--checkpoint.load_iteration=3"], resumed_ranks)]  # fmt: skip
    finished = launch_commands(commands) if commands else {}
    return {c.key: (finished[c.key], c.directory) for c in commands}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_resumes_at_another_ep(runs, case):
    whole = losses_of(runs, f"{case}_whole")
    assert sorted(whole) == list(range(1, 7))
    resumed = losses_of(runs, f"{case}_resumed")
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(whole[iteration], rel=1e-5), iteration
