"""dtgpt.parallel.schedules builds a schedule at every micro-batch count, and each program is sound.

No processes: every schedule is built for pp rank 0 under PyTorch's "fake" process group, and
the program it holds for every rank (torch computes them all on each rank) is checked with
torch's own dry run (_simulate_comms_compute: each send matched, no rank waiting forever) and
for completeness (every stage runs its forward and backward of every micro-batch once). Real
ranks against one process: tests/test_parity_pipeline_counts.py.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtgpt.config import V_SHAPED_SCHEDULES, interleaved_round_size
from dtgpt.parallel.pipeline import stage_ids_on_rank
from dtgpt.parallel.schedules import build_schedule

F, B, I, W = torch_schedules.F, torch_schedules.B, torch_schedules.I, torch_schedules.W
SEND_RECV = {torch_schedules.SEND_F, torch_schedules.RECV_F, torch_schedules.SEND_B, torch_schedules.RECV_B}
# DualPipeV's programs hold overlapped forward-backward actions the dry run does not model.
SIMULATED = ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS", "ZBVZeroBubble")
LAYOUTS = [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3)]  # (pp, stages per rank)


@pytest.fixture
def fake_pp_group(request):
    """A fake process group of pp ranks, this process rank 0."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def rank0_stages(schedule: str, pp: int, per_rank: int) -> list[PipelineStage]:
    total = pp * per_rank
    ids = stage_ids_on_rank(0, pp, per_rank, schedule)
    return [PipelineStage(torch.nn.Linear(2, 2), stage_index=i, num_stages=total, device=torch.device("cpu")) for i in ids]


def build(schedule: str, pp: int, per_rank: int, n: int):
    return build_schedule(schedule, rank0_stages(schedule, pp, per_rank), n, loss_fn=lambda out, target: out.sum())


def check_program(schedule, stages: int, n: int) -> None:
    """Complete and free of deadlock, by torch's dry run."""
    program = {
        rank: [a for a in actions if a is not None and (a.computation_type in (F, B, I, W) or a.computation_type in SEND_RECV)]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }
    runs = Counter((a.stage_index, a.computation_type, a.microbatch_index) for actions in program.values() for a in actions)
    for stage in range(stages):
        for mb in range(n):
            assert runs[(stage, F, mb)] == 1, f"stage {stage} micro-batch {mb}: forwards {runs[(stage, F, mb)]}"
            full, split = runs[(stage, B, mb)], (runs[(stage, I, mb)], runs[(stage, W, mb)])
            assert (full, split) in ((1, (0, 0)), (0, (1, 1))), f"stage {stage} micro-batch {mb}: backwards {full}, {split}"
    with contextlib.redirect_stdout(io.StringIO()):  # the dry run prints its table when it is stuck
        torch_schedules._simulate_comms_compute(program, lambda s: schedule.stage_index_to_group_rank[s], stages)


# V-shaped schedules hold exactly two stages per rank.
CASES = [(name, pp, v) for name in SIMULATED for pp, v in LAYOUTS if v == 2 or name not in V_SHAPED_SCHEDULES]


@pytest.mark.parametrize("name,fake_pp_group,per_rank", CASES, indirect=["fake_pp_group"])
def test_every_count_builds_a_sound_program(name, fake_pp_group, per_rank):
    pp = fake_pp_group
    for n in range(1, 4 * pp + 3):
        check_program(build(name, pp, per_rank, n), pp * per_rank, n)


@pytest.mark.parametrize("fake_pp_group", [2, 4], indirect=True)
@pytest.mark.parametrize("name", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_interleaved_rounds_are_torchs_wherever_torch_runs_the_count(fake_pp_group, name):
    """The same rounds as torch's own class where it accepts the count; where it refuses one
    (its rounds do not divide it), rounds that do."""
    pp, refused = fake_pp_group, []
    for n in range(1, 4 * pp + 3):
        ours = build(name, pp, 2, n)
        assert n % ours.microbatches_per_round == 0 and (ours.microbatches_per_round >= pp or ours.number_of_rounds == 1)
        try:
            theirs = torch_schedules.get_schedule_class(name)(rank0_stages(name, pp, 2), n_microbatches=n)
        except ValueError:
            refused.append(n)
            continue
        assert ours.microbatches_per_round == theirs.microbatches_per_round == interleaved_round_size(n, pp)
        assert ours.pipeline_order == theirs.pipeline_order
    assert refused, "torch refused no count: the rounds of dtgpt.parallel.schedules may no longer be needed"


@pytest.mark.parametrize("fake_pp_group", [2, 4], indirect=True)
def test_one_f_one_b_builds_fewer_micro_batches_than_stages(fake_pp_group):
    """torch's Schedule1F1B refuses them; the step is torch's either way (parity: real ranks)."""
    pp = fake_pp_group
    stage = rank0_stages("1F1B", pp, 1)
    with pytest.raises(ValueError, match="must be greater than or equal to the number of stages"):
        torch_schedules.Schedule1F1B(stage[0], n_microbatches=pp - 1)
    for n in range(1, pp + 1):
        assert build("1F1B", pp, 1, n)._n_microbatches == n


@pytest.mark.parametrize("fake_pp_group", [2], indirect=True)
def test_dual_pipe_v_needs_a_micro_batch_per_stage(fake_pp_group):
    """The one count rule validation keeps (config.parallel_rules.check_pipeline_microbatches)."""
    stages = 2 * fake_pp_group
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        build("DualPipeV", fake_pp_group, 2, stages - 1)
    build("DualPipeV", fake_pp_group, 2, stages)


class _Torch211Stage:
    """The stand-in forward's set-up as torch 2.11 declares it (2.13 adds has_backward)."""

    device = "cpu"

    def _prepare_forward_infra(self, num_microbatches, args, kwargs=None):
        self.seen = (num_microbatches, args, kwargs)
        return ()


class _Torch213Stage:
    device = "cpu"

    def _prepare_forward_infra(self, num_microbatches, args, kwargs=None, has_backward=False):
        self.seen = (num_microbatches, args, kwargs, has_backward)
        return ()


@pytest.mark.parametrize("base", [_Torch211Stage, _Torch213Stage], ids=["torch-2.11", "torch-2.13"])
def test_stage_hooks_pass_torchs_own_arguments_through(base):
    """dtgpt's stage hands micro-batch 0's documents to the shape-inferring forward and passes
    everything else as torch gave it: naming 2.13's has_backward broke every pipelined run on 2.11."""
    from dtgpt.attention_varlen import Documents
    from dtgpt.parallel.pipeline import _StageHooks

    stage = type("Stage", (_StageHooks, base), {})()
    stage.micro_batch_documents = ["bounds of micro-batch 0", "bounds of micro-batch 1"]
    ids = torch.zeros(1, 4, dtype=torch.long)
    extra = {"has_backward": True} if base is _Torch213Stage else {}
    stage._prepare_forward_infra(2, (ids,), {"document_ids": ids}, **extra)
    kwargs = stage.seen[2]
    assert isinstance(kwargs["document_ids"], Documents) and kwargs["document_ids"].bounds == "bounds of micro-batch 0"
    assert stage.seen[3:] == ((True,) if extra else ())


def test_stage_hooks_drop_the_warm_up_send_to_their_own_rank():
    """torch 2.11 warms up a V schedule's same-rank neighbour with a send to itself, which gloo
    refuses ("Pair is not connected"): dtgpt's stage keeps only the ops to other ranks."""
    from types import SimpleNamespace

    from dtgpt.parallel.pipeline import _StageHooks

    class _Torch211Neighbours:
        def _get_init_p2p_neighbors_ops(self):
            return [SimpleNamespace(group_peer=peer) for peer in (0, 1, 1, 0)]

    stage = type("Stage", (_StageHooks, _Torch211Neighbours), {})()
    stage.group_rank = 1
    assert [op.group_peer for op in stage._get_init_p2p_neighbors_ops()] == [0, 0]
