"""Failure detection (dtgpt/faults/detect.py) on 3 real gloo processes: a rank blocked in a
collective on a *live* peer (the case gloo never wakes by itself before its timeout) leaves it
as soon as a failure is declared, and the processes can still build a new group afterwards, as
the survivors' save does. A TCP connection each process holds of its own (opened before its
groups) is left alone: only the groups' sockets are shut."""

from __future__ import annotations

import json
import multiprocessing
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtgpt.faults import group_sockets
from dtgpt.faults.detect import NOTICE, FailureDetector

TIMEOUT = timedelta(minutes=5)
"""The collectives' own timeout: far beyond BOUND_S, so a timeout cannot pass for detection."""
BOUND_S = 60.0
"""Generous: the detector checks every 0.5 s; a loaded 2-core machine may delay it by seconds."""


def _rank(rank: int, port: int, echo_port: int, declarer: int, watch: bool, out: str) -> None:
    own = socket.create_connection(("127.0.0.1", echo_port), timeout=60)  # a client the script holds
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    group_sockets.install()  # as dtgpt.distributed does before its groups
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=TIMEOUT)
    attempt = dist.PrefixStore("attempt", store)
    # Rank 0's watch may be off: then only the peer it waits on leaving can wake it.
    detector = FailureDetector(attempt, rank, poll_s=0.5 if watch or rank != 0 else 3600)
    pair = dist.new_group([0, 1])
    dist.barrier()
    record = {}
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=pair)  # rank 1 is alive and never joins
            record["left"] = "completed"
        except RuntimeError as e:
            record["left"] = str(e).splitlines()[0]
        record["seconds"] = time.monotonic() - start
    elif rank == declarer:
        time.sleep(2.0)  # rank 0 is blocked by now
        detector.declare("rank 3 died (a test's word for it)\nsecond line")
    attempt.add("waited", 1)
    while attempt.add("waited", 0) < 3:  # rank 1 stays alive until rank 0 has left
        time.sleep(0.05)
    # What the survivors' save does next: a new group over the old ones, and a collective on it.
    # First each leaves on its own thread, as a survivor's declare() does: a watch still leaving
    # (slow under load) would shut the new group's sockets with the old ones'.
    detector.leave()
    group = dist.new_group([0, 1, 2], backend="gloo")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    own.sendall(b"ping\n")
    reply = own.makefile().readline()
    record.update(total=total.item(), notice=detector.notice(), left_at=detector.left_at, own=reply.strip())
    detector.close()
    Path(out, f"{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def run_ranks(tmp_path: Path, declarer: int, watch: bool = True) -> dict[int, dict]:
    # The store lives here, as torchrun's agent hosts it, so no rank's exit takes it down.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    port = server.port
    echo = socket.create_server(("127.0.0.1", 0))

    def answer_each(connection):
        with connection, connection.makefile() as lines:
            for _ in lines:
                connection.sendall(b"pong\n")

    def serve():
        while True:
            try:
                connection, _ = echo.accept()
            except OSError:
                return
            threading.Thread(target=answer_each, args=(connection,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    ctx = multiprocessing.get_context("spawn")
    args = (port, echo.getsockname()[1], declarer, watch, str(tmp_path))
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    echo.close()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    return {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)}


@pytest.mark.slow
@pytest.mark.parametrize("declarer,watch", [(2, True), (1, False)], ids=["a-third-rank-declares", "the-peer-declares"])
def test_a_rank_blocked_on_a_live_peer_leaves_when_a_failure_is_declared(tmp_path, declarer, watch):
    """Rank 0 waits in an all-reduce with rank 1, which is alive and never joins. A third rank
    declares a failure (rank 0's watch sees the notice), or rank 1 itself does (rank 0's watch
    is off: rank 1 leaving its collectives is what wakes rank 0). Either way rank 0's all-reduce
    fails long before its 5-minute timeout, every rank has left, and a new group works."""
    records = run_ranks(tmp_path, declarer, watch)
    blocked = records[0]
    assert blocked["left"] != "completed" and "Timed out" not in blocked["left"], blocked
    assert blocked["seconds"] < BOUND_S, blocked
    assert all(r["total"] == 3.0 for r in records.values())  # 0 + 1 + 2 over the new group
    assert all(r["own"] == "pong" for r in records.values())  # the process's own connection still works
    assert all(r["notice"]["rank"] == declarer for r in records.values())
    assert blocked["notice"]["why"] == "rank 3 died (a test's word for it)"  # its first line
    assert records[declarer]["left_at"] is not None  # the declarer left at once; the others when they saw it


def test_no_notice_no_leaving():
    """Without a notice the watch never acts: the store key is absent, nothing is left."""
    store = dist.HashStore()
    left = []
    detector = FailureDetector(store, 0, poll_s=0.05, leave=left.append)
    time.sleep(0.3)
    assert detector.notice() is None and detector.left_at is None and not left
    store.set(NOTICE, json.dumps({"rank": 1, "why": "x", "at": time.time()}))
    deadline = time.monotonic() + 30
    while detector.left_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
    detector.close()
    assert len(left) == 1 and detector.left_at is not None
    detector.leave()
    assert len(left) == 1  # once


def test_the_launchers_word_that_a_worker_died_makes_the_watch_leave():
    """Under dtgpt.run the agent bumps its death count as soon as a worker dies: the watch leaves
    then, though no collective of this rank has failed (on NCCL a survivor may sit in a host sync)."""
    from dtgpt.run.keys import DEATHS_KEY

    shared = dist.HashStore()
    shared.add(DEATHS_KEY, 1)  # an earlier death, already recovered from: not news
    left = []
    detector = FailureDetector(dist.PrefixStore("attempt", shared), 0, poll_s=0.05, leave=left.append)
    time.sleep(0.3)
    assert not left
    shared.add(DEATHS_KEY, 1)
    deadline = time.monotonic() + 30
    while not left and time.monotonic() < deadline:
        time.sleep(0.05)
    detector.close()
    assert len(left) == 1 and detector.notice() is None  # it left; the notice is the failing rank's to post


def test_a_peer_gone_is_a_closed_connection_not_any_error():
    """How the first survivor to fail, with no roll call to say a rank died, tells a dead peer
    (it exits on one line) from its own error (a bug, or a timeout: it keeps its traceback)."""
    from dtgpt.faults.detect import peer_gone

    closed = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:933."
    reset = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:47493: Connection reset by peer."
    assert peer_gone(RuntimeError(closed)) and peer_gone(RuntimeError(reset)) and peer_gone(OSError("[Errno 32] Broken pipe"))
    assert not peer_gone(RuntimeError("injected bug in the model's forward (iteration 3)"))
    assert not peer_gone(RuntimeError("[pair.cc:446] Timed out waiting 6000ms for recv operation to complete"))
    assert not peer_gone(ValueError(closed))  # not a collective's error
