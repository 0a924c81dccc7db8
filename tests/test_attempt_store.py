"""The attempt store: restarted ranks agree on a fresh prefix, whatever the last attempt left."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from dtgpt.faults.attempt_store import ROOT, attempt_store

TIMEOUT = timedelta(seconds=20)


def run_attempt(server: dist.TCPStore, world_size: int, late: set[int] = frozenset()) -> list[str]:
    """Every rank of one attempt in a thread (ranks in `late` start after the others); their tokens."""
    tokens: list[str | None] = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
            store, tokens[rank] = attempt_store(client, rank, world_size, TIMEOUT)
            store.set(f"rank{rank}", "here")  # under the attempt's prefix
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = {r: threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)}
    for r in sorted(threads, key=lambda r: r in late):
        threads[r].start()
        if r in late:
            threads[r].join(timeout=0.3)  # the others are waiting by now
    for t in threads.values():
        t.join(timeout=30)
    assert not errors, errors
    return tokens


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def test_every_rank_agrees_on_one_token(server):
    tokens = run_attempt(server, 4)
    assert len(set(tokens)) == 1
    assert server.get(f"{ROOT}/{tokens[0]}/rank3") == b"here"


def test_a_restarted_attempt_is_not_fooled_by_the_last_ones_keys(server):
    """Attempt 1 leaves its hellos, replies and token behind; attempt 2's rank 0 starts first and
    reads those stale hellos, rank 1 and 3 start late: all four still agree on a new token."""
    first = run_attempt(server, 4)[0]
    server.set(f"{ROOT}/hello/2", "a-dead-process")  # a rank that died after publishing
    second = run_attempt(server, 4, late={1, 3})
    assert len(set(second)) == 1 and second[0] != first
    assert server.get(f"{ROOT}/{second[0]}/rank1") == b"here"


def test_one_rank_needs_no_handshake(server):
    assert len(run_attempt(server, 1)) == 1
