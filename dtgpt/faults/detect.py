"""Failure detection: when one rank fails, every survivor knows within a second and leaves the
collective it is blocked in, so last words (last_words.py) never wait for a collective timeout.

A rank that dies takes its connections with it: a peer waiting on it fails at once ("Connection
closed by peer"). A peer waiting on a *live* rank does not: in HSDP, a survivor that shares no
group with the dead rank waits on survivors that have already left the collective, until
`distributed.timeout_minutes` (10) passes, long after torchrun's SIGKILL (its grace is 30 s).
Gloo offers nothing else to wake it: `ProcessGroup.abort()`, `shutdown()` or the peer's
`destroy_process_group()` leave it blocked. So:

1. **Notice.** The first rank whose collective fails in the train step posts a notice (its rank
   and the error) in this attempt's store (attempt_store.py); later ones find it posted.
2. **Watch.** A thread on every rank checks for the notice every `POLL_S` seconds on a store
   connection of its own (the main thread may be blocked, or using the store itself), and for
   the launcher's word that a worker died (`python -m dtgpt.run` counts deaths in its store,
   dtgpt/run/keys.py `DEATHS_KEY`): on NCCL a survivor may sit in a host synchronisation that no
   failed collective of its own would end, so the launcher's word is what makes it leave.
3. **Leave.** Whoever learns first on a rank, the thread or the failing main thread, makes this
   process leave its collectives, once (`leave_collectives`): NCCL groups are aborted, which wakes
   a blocked collective by construction; gloo's connections are shut down (`shutdown(2)` on the
   sockets its groups opened, recorded as each group was made: group_sockets.py; any other
   connection of the process, a training script's own client say, is left alone, and so is the
   store's), which is exactly the dead-peer case gloo already handles: every collective of this
   process fails at once, and so does every peer's collective waiting on this process. The
   process groups are not used again: last words save over a new group, whose connections are
   made after this.

The bound: a rank learns within `POLL_S` of the notice and leaves at once; a rank blocked on a
rank that left fails as soon as that one has. The collective timeout stays the fallback for a
stuck rank that is alive (a hang), which posts no notice until someone times out.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dtgpt.faults import group_sockets
from dtgpt.run.keys import DEATHS_KEY

NOTICE = "failure/notice"
POLL_S = 0.5
"""How often the watch checks for a notice: the detection bound, one store request per check."""
ESTABLISHED = "01"  # the state column of /proc/net/tcp


def store_ports(store: dist.Store) -> set[int]:
    """The TCP ports of the TCPStore under `store` (PrefixStores unwrapped): its connections are spared."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return {store.port} if isinstance(store, dist.TCPStore) else set()


def _tcp_table() -> dict[str, tuple[int, int, str]]:
    """{socket inode: (local port, remote port, state)} of this network namespace (Linux)."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote = (int(address.rsplit(":", 1)[1], 16) for address in fields[1:3])
            table[fields[9]] = (local, remote, fields[3])
    return table


def shut_connections(spare_ports: set[int], inodes: set[str]) -> int:
    """shutdown(2) this process's established TCP connections among the socket `inodes`, except
    those to or from `spare_ports`; returns how many. The file descriptors stay open (their owners
    close them): closing them under gloo's event loop could hand a reused number to the wrong reader."""
    table, shut = _tcp_table(), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        inode = link[len("socket:[") : -1] if link.startswith("socket:[") else None
        entry = table.get(inode) if inode in inodes else None
        if entry is None or entry[2] != ESTABLISHED or spare_ports & {entry[0], entry[1]}:
            continue
        try:
            sock = socket.socket(fileno=int(fd))
        except OSError:  # closed since it was listed (EBADF): nothing left to shut
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return shut


def leave_collectives(spare_ports: set[int]) -> None:
    """Make every collective of this process, running or future, fail now (see the module doc)."""
    for group in list(c10d._world.pg_map):
        if "nccl" in dist.get_backend(group):
            group.abort()  # wakes a blocked NCCL collective; gloo's abort() would wake nothing
    inodes = group_sockets.take()
    if inodes and os.path.isdir("/proc/self/fd"):
        shut_connections(spare_ports, inodes)


def summary(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    first_line = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first_line}" if first_line else type(e).__name__


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What gloo says when a collective fails because a peer's connection is gone."""


def peer_gone(e: BaseException) -> bool:
    """Whether `e` is a collective that failed because a peer's process went away (it died, or
    left its collectives after failing first). Only for what a survivor prints as it exits (one
    line instead of a traceback); never for a recovery: the launcher says who died (recovery.py)."""
    return isinstance(e, (RuntimeError, OSError)) and any(words in str(e) for words in PEER_GONE)


class FailureDetector:
    """Posts and watches the failure notice of this attempt; leaves the collectives once."""

    def __init__(self, store: dist.Store, rank: int, poll_s: float = POLL_S, leave=leave_collectives):
        self.store, self.rank, self.poll_s, self._leave = store, rank, poll_s, leave
        self.spare_ports = store_ports(store)
        self.left_at: float | None = None
        """time.time() when this rank left its collectives; None until then."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A connection of its own: a check never queues behind the main thread's store calls.
        self._watcher_store = store.clone()
        self._launcher_store = getattr(self._watcher_store, "underlying_store", None)  # the launcher's keys: no prefix
        self._deaths = self._launcher_deaths()
        self._thread = threading.Thread(target=self._watch, name="dtgpt-failure-detector", daemon=True)
        self._thread.start()

    def declare(self, why: str) -> None:
        """This rank's collective failed: post the notice (unless one is), then leave."""
        first_line = (why.strip().splitlines() or [""])[0][:200]
        notice = json.dumps({"rank": self.rank, "why": first_line, "at": time.time()})
        self.store.compare_set(NOTICE, "", notice)
        self.leave()

    def notice(self) -> dict | None:
        """The posted notice ({"rank", "why", "at"}), or None."""
        if not self.store.check([NOTICE]):
            return None
        return json.loads(self.store.get(NOTICE))

    def leave(self) -> None:
        """Leave every collective, once; returns when done (the caller may then build new groups)."""
        with self._lock:
            if self.left_at is None:
                self._leave(self.spare_ports)
                self.left_at = time.time()

    def _launcher_deaths(self) -> int:
        """How many worker deaths the launcher has posted (0 without one)."""
        return self._launcher_store.add(DEATHS_KEY, 0) if self._launcher_store is not None else 0

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if not self._watcher_store.check([NOTICE]):
                    if self._launcher_deaths() > self._deaths:
                        print(f"failure: rank {self.rank} learned from the launcher that a worker died; leaving its "
                              "collectives", flush=True)  # fmt: skip
                        self.leave()
                        return
                    continue
                notice = json.loads(self._watcher_store.get(NOTICE))
            except (RuntimeError, OSError, ValueError):  # the store went away: the job is ending
                return
            if notice["rank"] != self.rank:
                print(f"failure: rank {self.rank} learned {time.time() - notice['at']:.2f} s after it that rank "
                      f"{notice['rank']} failed ({notice['why']}); leaving its collectives", flush=True)  # fmt: skip
            self.leave()
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s + 1)
