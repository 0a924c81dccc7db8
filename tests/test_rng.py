"""Megatron's dropout RNG under tensor parallelism (dtgpt/parallel/rng.py), on 2 real gloo ranks.

In tensor-parallel regions (attention dropout on each rank's heads, hidden dropout on a
sequence-parallel chunk) the tp ranks must draw independent masks; in replicated regions (the
embedding's dropout, hidden dropout without sequence parallelism) the same mask. Both streams
must survive a checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint

from dtgpt.parallel.rng import ModelParallelRNG, model_parallel_seed, stage_seed
from tests.runs import REPO

INDEPENDENT = 0.05
"""|correlation| bound for independent masks: each holds >= 16k Bernoulli(0.5) draws, so the
sample correlation of independent ones has a standard deviation below 1/sqrt(16k) ~ 0.008; the
draws are seeded, so the value is fixed (no flakiness), and a shared stream would give 1."""


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.flatten().float(), b.flatten().float()]))[0, 1].item()


@pytest.fixture(scope="module")
def masks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rng")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(REPO / "tests/rng_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def tp_region(sp: bool, name: str) -> bool:
    return name.endswith("core") or (sp and name.startswith("layers.") and name.endswith(".dropout"))


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_tp_regions_draw_independent_masks_replicated_regions_equal_ones(masks, sp):
    rank0, rank1 = (m[f"sp{int(sp)}"]["draw 1"] for m in masks)
    assert set(rank0) == {"embedding.dropout", "layers.0.dropout", "layers.1.dropout", "layers.0.attention.core", "layers.1.attention.core"}
    for name in rank0:
        a, b = rank0[name], rank1[name]
        assert 0.4 < a.float().mean() < 0.6, name  # dropout 0.5 did drop
        if tp_region(sp, name):
            assert abs(correlation(a, b)) < INDEPENDENT, name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_both_streams_survive_save_and_load(masks, sp):
    for rank in masks:
        drawn = rank[f"sp{int(sp)}"]
        for name in drawn["draw 2"]:
            assert torch.equal(drawn["after load"][name], drawn["draw 2"][name]), name
            assert not torch.equal(drawn["draw 1"][name], drawn["draw 2"][name]), name  # the streams move on


def test_seeds_are_megatrons():
    assert stage_seed(1234, pp_rank=2) == 1234 + 200
    assert model_parallel_seed(1234, pp_rank=2, tp_rank=3) == 1234 + 200 + 2718 + 3
    # a re-derived seed (another mesh) moves with the iteration
    assert stage_seed(1234, 0, iteration=7) != stage_seed(1234, 0, iteration=8)


def test_fork_leaves_the_default_stream_alone():
    rng = ModelParallelRNG(torch.device("cpu"), seed=5)
    torch.manual_seed(0)
    with rng.fork():
        forked = torch.rand(4)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))  # as if the fork had not happened
    assert torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(5)))
    with rng.fork():
        assert not torch.equal(torch.rand(4), forked)  # the forked stream continues


def test_recomputation_replays_the_model_parallel_stream():
    """A recomputed tp-region dropout must redraw the forward's mask, or gradients are wrong."""
    rng = ModelParallelRNG(torch.device("cpu"), seed=5)
    x = torch.randn(1000, requires_grad=True)

    def tp_dropout(x):
        with rng.fork():
            return torch.nn.functional.dropout(x * 1.0, 0.5)

    y = torch.utils.checkpoint.checkpoint(tp_dropout, x, use_reentrant=False, context_fn=rng.recompute_contexts)
    after_forward = rng.state.clone()
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() * 2.0)
    assert torch.equal(rng.state, after_forward)  # the recomputation leaves the stream where forward did
