"""Expert parallelism trains the same MoE model as one process (DESIGN invariant 1), and its
checkpoints are mesh-free (invariant 3).

The tiny fp32 GPT of tests/runs.py with every block's MLP an MoE layer: dropless top-2 over 4
experts (grouped GEMM, the load-balancing loss on). Each layout must match the one-process run
to relative 1e-5 (tests/parity_oracle.py): loss and gradient norm of every iteration, and every
parameter after the last, read whole from the run's final checkpoint (the experts' parameters
keep their full (E, ...) shapes whatever ep is). EP is folded out of the data-parallel ranks:
ep2 on dp_shard 2, ep4 on dp_shard 4, ep2 on dp_shard 4 (the experts' FSDP then shards over
the 2 ranks that remain), ep2 under a 2-stage pipeline, tp2 + SP with ep1 and ep2, and ep2 on
the two ranks of cp2.

A run saved at ep2 resumes at ep1 and one saved at ep1 resumes at ep2, each equal to the
uninterrupted run to fp32 rounding.
"""

import pytest

from tests.parity_oracle import assert_same_training
from tests.runs import TINY, read_metrics, run_train, train_run

pytestmark = pytest.mark.slow  # torchrun launches

STEPS = 5
RUN = [f"--training.train_iters={STEPS}", f"--optimizer.lr_decay_iters={STEPS}"]
MOE = ["--model.num_experts=4", "--model.moe_router_topk=2", "--model.moe_grouped_gemm=true", "--model.moe_aux_loss_coeff=1e-2"]


def ep(size: int) -> str:
    return f"--parallel.expert_model_parallel_size={size}"


TP2_SP = ["--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]
LAYOUTS = {
    # name: (ranks, overrides)
    "ep2": (2, ["--parallel.data_parallel_shard_size=2", ep(2)]),
    "ep4": (4, ["--parallel.data_parallel_shard_size=4", ep(4)]),
    "ep2_dp_shard4": (4, ["--parallel.data_parallel_shard_size=4", ep(2)]),
    "ep2_pp2": (4, ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B", ep(2)]),
    # each tp rank routes its own sequence chunk (its ep group: the same tp coordinate)
    "tp2_sp": (2, TP2_SP),
    "ep2_tp2_sp": (4, ["--parallel.data_parallel_shard_size=2", *TP2_SP, ep(2)]),
    # ep folded onto the cp ranks: each routes its own chunks of every sequence
    "ep2_cp2": (2, ["--parallel.context_parallel_size=2", ep(2)]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("reference"), RUN + MOE, name="single")


@pytest.mark.parametrize("ranks,overrides", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_expert_parallel_layout_matches_single_process(tmp_path, reference, ranks, overrides):
    assert len(reference["loss"]) == STEPS and reference["loss"][-1] < reference["loss"][0]
    got = train_run(tmp_path, RUN + MOE + overrides, nproc=ranks)
    assert got["params"][STEPS]["layers.0.mlp.experts.fc1_weight"].shape[0] == 4  # saved whole
    assert_same_training(got, reference, STEPS)


RESUME = [*TINY, *MOE, "--training.train_iters=6", "--optimizer.lr_decay_iters=6"]


def losses_of(tmp_path, name: str, args: list[str], nproc: int) -> dict[int, float]:
    metrics = tmp_path / f"{name}.jsonl"
    run_train(tmp_path, RESUME + args + [f"--logging.metrics_file={metrics}"], nproc=nproc, name=name)
    return {r["iteration"]: r["loss"] for r in read_metrics(metrics)}


@pytest.mark.parametrize("saved_at,resumed_at", [(2, 1), (1, 2)], ids=["ep2_to_ep1", "ep1_to_ep2"])
def test_a_checkpoint_resumes_at_another_ep(tmp_path, saved_at, resumed_at):
    def layout(size: int) -> tuple[list[str], int]:
        return (["--parallel.data_parallel_shard_size=2", ep(2)], 2) if size == 2 else ([], 1)

    root = tmp_path / "ckpt"
    args, ranks = layout(saved_at)
    whole = losses_of(tmp_path, "whole", args + [f"--checkpoint.save={root}", "--checkpoint.save_interval=3"], ranks)
    assert sorted(whole) == list(range(1, 7))
    args, ranks = layout(resumed_at)
    resumed = losses_of(tmp_path, "resumed", args + [f"--checkpoint.load={root}", "--checkpoint.load_iteration=3"], ranks)
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(whole[iteration], rel=1e-5), iteration
