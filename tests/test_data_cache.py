"""build_once: rank 0 builds while the other ranks wait at a barrier; nobody builds twice."""

import multiprocessing
import os
import time

import pytest
import torch.distributed as dist  # imported before forking, so the ranks start at once


from dtgpt.data.cache import build_once, description_hash, index_cache_dir


def _rank(rank, world, store_path, target, log):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        def build():
            time.sleep(0.5)  # a slow build: the other rank must wait, not build too
            with open(log, "a") as f:
                f.write(f"built by {rank}\n")
            with open(target, "w") as f:
                f.write("done")

        build_once(lambda: os.path.exists(target), build)
        assert open(target).read() == "done"
    finally:
        dist.destroy_process_group()


def test_rank0_builds_others_wait(tmp_path):
    ctx = multiprocessing.get_context("fork")
    args = (str(tmp_path / "store"), str(tmp_path / "target"), str(tmp_path / "log"))
    procs = [ctx.Process(target=_rank, args=(r, 2, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert (tmp_path / "log").read_text() == "built by 0\n"


def test_single_process_builds_once(tmp_path):
    calls = []
    target = tmp_path / "t"
    for _ in range(2):
        build_once(target.exists, lambda: calls.append(1) or target.write_text("x"))
    assert calls == [1]
    with pytest.raises(OSError, match="disk full"):
        build_once(lambda: False, lambda: (_ for _ in ()).throw(OSError("disk full")))


def test_keys_and_places(tmp_path):
    assert description_hash({"a": 1, "b": [2]}) == description_hash({"b": [2], "a": 1})
    assert description_hash({"a": 1}) != description_hash({"a": 2})
    assert index_cache_dir(str(tmp_path), "/data/x") == os.path.join(str(tmp_path), "GPTDataset_indices")
    assert index_cache_dir("", str(tmp_path / "d" / "x")) == str(tmp_path / "d" / "cache" / "GPTDataset_indices")
