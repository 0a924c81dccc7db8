"""A store of this attempt's own: a group that torchrun restarted never reads the last one's keys.

torchrun (>= 2.5) hosts one TCPStore in its agent for the whole job and hands it to the workers
of every attempt (`TORCHELASTIC_USE_AGENT_STORE=True`). `init_process_group` and `new_group` key
their entries by group name ("0", "1", ...), and those names repeat in every attempt: a
restarted group found the dead attempt's entries (gloo: the dead ranks' addresses; store-based
barriers: their counts), connected to nothing and waited for the collective timeout
(pytorch/pytorch#135712).

So each attempt works under its own prefix, `dtgpt/<token>`, where `<token>` is a random token
drawn by this attempt's rank 0 and learned by every other rank in a handshake that stale keys
cannot fool: rank r publishes a fresh token of its own, and only a rank 0 that has read that
token can write the reply keyed by it. Rank 0 answers whatever every rank last published (an
answer to a dead process's token is never read) until each rank has confirmed under the new
prefix. Why this is safe across nodes: torchrun completes a rendezvous round only after every
node has stopped its old workers, so no worker of an older attempt is alive while one of this
attempt runs the handshake; the token is drawn per process, so nothing needs to agree beforehand.
`TORCHELASTIC_RESTART_COUNT` would not do: each node's agent keeps its own count, and a restart
for a membership change (a node waiting to join) does not count, so two nodes can disagree.

The same prefix holds the survivors' roll call after a hard failure (dtgpt/faults/last_words.py).
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import torch.distributed as dist

ROOT = "dtgpt"
POLL_S = 0.02


def attempt_store(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> tuple[dist.Store, str]:
    """(`store` under this attempt's prefix, the attempt's token). Every rank calls it once."""
    token = _lead(store, world_size, timeout) if rank == 0 else _follow(store, rank)
    return dist.PrefixStore(f"{ROOT}/{token}", store), token


def _follow(store: dist.Store, rank: int) -> str:
    mine = uuid.uuid4().hex
    store.set(f"{ROOT}/hello/{rank}", mine)
    reply = f"{ROOT}/reply/{mine}"
    store.wait([reply])  # the store's timeout: rank 0 never came
    token = store.get(reply).decode()
    store.add(f"{ROOT}/{token}/joined", 1)
    return token


def _lead(store: dist.Store, world_size: int, timeout: timedelta) -> str:
    token = uuid.uuid4().hex
    hellos = [f"{ROOT}/hello/{r}" for r in range(1, world_size)]
    if not hellos:
        return token
    store.wait(hellos)  # every rank has published once; some values may be a dead attempt's
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(f"{ROOT}/{token}/joined", 0) < len(hellos):
        published = [value.decode() for value in store.multi_get(hellos)]
        store.multi_set([f"{ROOT}/reply/{p}" for p in published], [token] * len(published))
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks of this attempt did not all join within {timeout.total_seconds():.0f} s")
        time.sleep(POLL_S)
    return token
