"""Last words after a hard failure (dtgpt/faults/last_words.py): the decision, the roll call, and the
done-when drill: 4 CPU ranks as dp_replicate 2 x dp_shard 2, one SIGKILLed mid-iteration under
`torchrun --max-restarts=1`, lose no iteration and end with the uninterrupted run's losses."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from dtgpt.faults.last_words import PREFIX, Report, decide, roll_call
from tests.faults.test_recovery import explain, fault_drill

REPLICAS = [[0, 1], [2, 3]]


def test_a_whole_replica_saves_the_last_completed_iteration():
    survivors = {r: Report(iteration=4, stepping=False) for r in (0, 1, 2)}
    assert decide(survivors, REPLICAS) == (4, "")


def test_no_last_words_inside_the_optimizer_step_or_without_a_whole_replica():
    stepping = {0: Report(4, False), 1: Report(4, True), 2: Report(4, False)}
    assert decide(stepping, REPLICAS)[0] is None and "rank 1 was inside the optimizer step" in decide(stepping, REPLICAS)[1]
    split = {0: Report(4, False), 3: Report(4, False)}
    assert decide(split, REPLICAS) == (None, "no replica of the model and optimizer is whole without rank(s) [1, 2]")
    no_replicas = {r: Report(4, False) for r in (0, 1, 2)}
    assert decide(no_replicas, [[0, 1, 2, 3]])[0] is None
    apart = {0: Report(4, False), 1: Report(5, False)}
    assert decide(apart, [[0, 1]]) == (None, "the survivors completed different iterations [4, 5]")


def test_the_roll_call_gives_every_survivor_the_same_list():
    """Rank 3 is dead (never answers); rank 2 answers once the roll is closed: it is left out, and
    the others agree on [0, 1] whatever order they close the roll in. Rank 2 waits for the closed
    roll rather than for a time, and ranks 0 and 1 answer at once into a window far longer than
    the few store requests between their answers, so a loaded machine cannot reorder them."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    clients = {r: dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60)) for r in range(3)}
    rolls: dict[int, object] = {}

    def survivor(rank: int) -> None:
        late = rank == 2
        if late:
            clients[rank].wait([f"{PREFIX}/roll"])  # the roll is closed
        rolls[rank] = roll_call(clients[rank], rank, 4, Report(7, False), seconds=0.1 if late else 3.0)

    threads = [threading.Thread(target=survivor, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(rolls[0]) == sorted(rolls[1]) == [0, 1]
    assert rolls[2] is None  # too late: it saves nothing


@pytest.mark.slow
def test_sigkill_on_hsdp_loses_no_iteration(tmp_path):
    """Rank 3 dies at the start of iteration 5 (its peers fail in forward/backward); ranks 0, 1
    and 2 hold replica 0 whole, save iteration 4 over their own group, and the restart resumes
    right after it: nothing is trained twice, every loss equals the uninterrupted run's."""
    # Every default: 10-minute collective timeout, 10 s roll call, torchrun's 30 s grace.
    drill = fault_drill.Drill(tmp_path, nproc=4, layout=fault_drill.HSDP, iters=6, grace=None)
    result = drill.sigkill(rank=3, iteration=5)
    log = result.runs[0].log
    assert "last words: ranks [0, 1, 2] saved iteration 4" in log, explain(result)
    assert result.outcome == "last words saved 4; restarted, resumed from 4", explain(result)
    assert result.lost == 0 and result.equal and result.intact and result.ok, explain(result)
