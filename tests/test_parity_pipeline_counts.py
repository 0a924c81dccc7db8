"""Pipelines at every micro-batch count a batch-size ramp-up produces train the one-process model.

torch's 1F1B refuses fewer micro-batches than stages, and its interleaved schedules refuse a
count their rounds do not divide; dtgpt.parallel.schedules runs both (Megatron's capped 1F1B
warm-up; rounds that divide the count). Each layout trains the tiny fp32 model through a ramp-up
(batches 2, 2, 2, 4, 6, 8, 10, 14, 16) and must match one process with the same ramp: the loss and
the gradient norm of every iteration to relative 1e-5 (DESIGN invariant 1), and every parameter
after the last step (read back from the final checkpoint).

- pp4 (1F1B, dp 1): 2 micro-batches on 4 stages (three iterations), then 4, 6, 8, 10, 14, 16.
- pp2 x dp2 (1F1B): GPT-3 175B's structure at 256 GPUs (dp 2, its ramp-up starting below pp
  micro-batches per rank): 1 micro-batch on 2 stages first.
- pp2 x vpp2 x dp2 (Interleaved1F1B): 1 (fewer than pp), then 5 and 7 micro-batches, which
  torch's rounds of 2 and 3 do not divide. InterleavedZeroBubble shares the construction; its
  programs at every count are checked without processes (tests/test_pipeline_schedules.py) and
  it runs against one process in tests/test_parity.py.
"""

from __future__ import annotations

import pytest

from tests.parity_oracle import whole_distance
from tests.runs import Run, result_of, selected_cases, train_runs

RTOL = 1e-5
# Parameters as one vector, ||theta - theta'|| / ||theta||: the one-process run with micro-batches
# of 2 (the same sums in another order) ends 4.9e-7 from it, the layouts here 4.5e-7 to 5.3e-7;
# one step fewer is 2.1e-2 away (torch 2.13 CPU, fp32).
PARAM_RTOL = 1e-5
STEPS = 9
RAMP = [
    "--training.global_batch_size=16",
    "--training.rampup_batch_size=[2,2,35]",
    f"--training.train_iters={STEPS}",
    f"--optimizer.lr_decay_iters={STEPS}",
    "--checkpoint.save_optimizer=false",  # the checkpoints are read for the model only
]
BATCHES = [2, 2, 2, 4, 6, 8, 10, 14, 16]
PP2_DP2 = ["--parallel.pipeline_model_parallel_size=2", "--parallel.data_parallel_shard_size=2"]
INTERLEAVED = [*PP2_DP2, "--parallel.virtual_pipeline_stages_per_rank=2"]
LAYOUTS = {
    "pp4_1f1b": ["--parallel.pipeline_model_parallel_size=4", "--parallel.pipeline_schedule=1F1B"],
    "pp2_dp2_1f1b": [*PP2_DP2, "--parallel.pipeline_schedule=1F1B"],
    "pp2_vpp2_dp2_interleaved_1f1b": [*INTERLEAVED, "--parallel.pipeline_schedule=Interleaved1F1B"],
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """The selected layouts and the one-process run, launched together (tests/runs.py train_runs)."""
    layouts = selected_cases(request, test_ramp_up_through_every_count_matches_one_process)
    batch = [Run(name, tmp_path_factory.mktemp(name), RAMP + LAYOUTS[name], 4) for name in layouts]
    return train_runs([*batch, Run("single", tmp_path_factory.mktemp("single"), RAMP)])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ramp_up_through_every_count_matches_one_process(runs, layout):
    got, one_process = result_of(runs, layout), result_of(runs, "single")
    assert one_process["global_batch_size"] == BATCHES  # the ramp-up goes through the counts named above
    assert got["global_batch_size"] == BATCHES
    for key in ("loss", "grad_norm"):
        for it, (g, w) in enumerate(zip(got[key], one_process[key], strict=True), start=1):
            assert g == pytest.approx(w, rel=RTOL), f"iteration {it}: {key} {g} vs one-process {w}"
    assert whole_distance(got["params"][STEPS], one_process["params"][STEPS]) <= PARAM_RTOL
