"""Megatron's --check-weight-hash-across-dp-replicas-interval on two real gloo ranks: replicas
holding the same weights pass, one changed element on one replica stops both with one message."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtgpt.parallel.replica_check import check_replicas, weights_digest


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    named = [("fc.weight", torch.randn(4, 3)), ("fc.bias", torch.randn(4).bfloat16())]
    check_replicas(named, dist.group.WORLD, 1)  # the same weights: passes
    if rank == 1:
        named[1][1][2] += 1e-2  # one element of one replica's bf16 bias
    try:
        check_replicas(named, dist.group.WORLD, 2)
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    with open(f"{out_dir}/rank{rank}.txt", "w") as f:
        f.write(message)
    dist.destroy_process_group()


@pytest.mark.slow
def test_replicas_that_differ_stop_every_rank(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert text.startswith("iteration 2: the weights of the data-parallel replicas differ (replica ranks [1]"), text


def test_digest_sees_names_values_and_dtypes():
    w = torch.arange(6.0).reshape(2, 3)
    base = weights_digest([("w", w)])
    assert base == weights_digest([("w", w.clone())])
    assert base != weights_digest([("v", w)])
    assert base != weights_digest([("w", w + torch.tensor([[0.0, 0, 0], [0, 0, 1e-6]]))])
    assert base != weights_digest([("w", w.double())])
