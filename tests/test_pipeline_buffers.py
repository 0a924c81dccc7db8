"""Pipeline receive buffers bounded by the micro-batches in flight (dtgpt/parallel/pipeline_buffers.py).

torch's PipelineStage keeps a receive buffer and a gradient receive buffer per micro-batch for
the stage's life (after one iteration of 32 micro-batches on pp2 the last stage holds 32
boundary activations, the first 32 gradient buffers). dtgpt's stages hold one of each per stage
while in flight and none after the iteration. The worker (tests/pipeline_buffers_worker.py)
measures both on 2 gloo ranks; the planner's count (dtgpt.plan.memory.pipeline_buffers) is held
against the measured peak.

    torchrun --nproc-per-node 2 tests/pipeline_buffers_worker.py OUT
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from dtgpt.parallel import pipeline_buffers
from dtgpt.plan import memory as pm
from tests.runs import REPO


def test_torch_has_the_stage_internals_the_adapter_replaces():
    """Fails when torch changes them: then pipeline_buffers.py needs a look (and CHECKED_TORCH a new entry)."""
    assert torch.__version__.startswith(pipeline_buffers.CHECKED_TORCH), torch.__version__
    assert pipeline_buffers.supported()
    if pipeline_buffers.DESCRIBES_RECEIVES:  # torch 2.13
        signatures = {
            "_setup_forward_recv_info": ["self", "num_microbatches", "has_backward"],
            "_setup_backward_recv_info": ["self", "num_microbatches"],
        }
    else:  # torch 2.11
        signatures = {
            "_prepare_forward_infra": ["self", "num_microbatches", "args", "kwargs"],
            "_prepare_backward_infra": ["self", "num_microbatches"],
            "clear_runtime_states": ["self"],
        }
    signatures |= {
        "_create_grad_recv_info": ["self", "act_send_info"],
        "forward_one_chunk": ["self", "fwd_chunk_id", "args", "kwargs", "save_forward_output"],
        "backward_one_chunk": ["self", "bwd_chunk_id", "loss", "full_backward", "last_backward"],
        "set_local_fwd_input": ["self", "prev_stage_outputs", "mb_index"],
        "set_local_bwd_input": ["self", "next_stage_bwd_outputs", "mb_index"],
    }
    for name, params in signatures.items():
        assert list(inspect.signature(getattr(PipelineStage, name)).parameters) == params, name
    # The receive infos: a buffer per micro-batch (set up by the methods above), root args without.
    source = inspect.getsource(PipelineStage)
    module = inspect.getsource(sys.modules[PipelineStage.__module__])
    if pipeline_buffers.DESCRIBES_RECEIVES:
        for attribute in ("self.args_recv_info[chunk_id]", "_make_tensor_from_meta(meta, self.device)", "self.fwd_cache[fwd_chunk_id]"):
            assert attribute in module, attribute
        assert "_setup_backward_recv_info(num_microbatches)" in source
    else:  # every micro-batch's buffer made in the forward set-up, its gradient's cleared by clear_runtime_states
        for attribute in ("self.args_recv_info[chunk_id] = recv_infos", "_make_tensor_from_meta(inp, self.device)", "a.buffer.grad = None"):
            assert attribute in module, attribute


def test_planner_counts_one_buffer_of_each_kind_per_stage():
    assert pm.pipeline_buffers([0], 1) == 0
    assert [pm.pipeline_buffers([r], 2) for r in range(2)] == [1, 1]
    assert [pm.pipeline_buffers([r], 4) for r in range(4)] == [1, 2, 2, 1]
    assert [pm.pipeline_buffers([r, r + 2], 4) for r in range(2)] == [3, 3]  # interleaved, 2 stages per rank
    assert [pm.pipeline_buffers([r, 3 - r], 4) for r in range(2)] == [2, 4]  # V-shaped


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("buffers") / "counts.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests/pipeline_buffers_worker.py"), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(out.with_name(f"{out.name}.{rank}").read_text()) for rank in range(2)]


@pytest.mark.slow  # a 2-rank launch (5 models), 30-100 s with the load
def test_no_boundary_activation_outlives_the_iteration_at_any_count(measured):
    for rank in measured:
        assert rank["1F1B/4"]["after"] == rank["1F1B/32"]["after"] == 0
        assert all(case["after"] == case["after_eval"] == 0 for name, case in rank.items() if not name.endswith("/torch"))
    # What torch's own stage keeps: a buffer per micro-batch (the last stage's activations, the
    # first's gradients), 3 per micro-batch on each rank of the interleaved pp2 x vpp2.
    assert [rank["1F1B/32/torch"]["after"] for rank in measured] == [32, 32]
    assert [rank["Interleaved1F1B/4/torch"]["after"] for rank in measured] == [12, 12]


@pytest.mark.slow
def test_the_numerics_are_torchs_stage_bit_for_bit(measured):
    """Losses of two training iterations and an evaluation, and every parameter after an SGD step."""
    for rank in measured:
        for name in ("1F1B/32", "Interleaved1F1B/4"):
            assert rank[name]["numerics"] == rank[f"{name}/torch"]["numerics"], name


@pytest.mark.slow
def test_peak_buffers_are_the_planners_count(measured):
    """1F1B holds exactly the planner's count at its peak; the interleaved schedule's program
    posts some receives early, and stays within it (rank 0 reaches 2 of its 3)."""
    for rank in measured:
        for name, case in rank.items():
            if name.endswith("/torch"):
                continue
            count = pm.pipeline_buffers(case["stages"], 4 if name.startswith("Interleaved") else 2)
            assert case["peak"] == count if name.startswith("1F1B") else 0 < case["peak"] <= count, (name, case)
        assert rank["1F1B/4"]["peak"] == rank["1F1B/32"]["peak"]
