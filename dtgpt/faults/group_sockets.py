"""The TCP connections of this process's gloo groups, recorded as each group is made, so that
failure detection (detect.py) can shut those and no other socket of the process.

gloo connects every pair of a group's ranks when the group is built (eagerly, unless
TORCH_GLOO_LAZY_INIT is set, which dtgpt never sets). Every group of every kind (the default
group, `new_group`, a DeviceMesh's groups) is built by one private function of torch's,
`distributed_c10d._new_process_group_helper`; `install()` wraps it so that the sockets the process
opened while it ran are recorded as the group's. This module is the one place that knows that
function (its presence is checked; without it nothing is recorded, and detect.py shuts nothing:
a survivor then waits for its collective timeout instead).

Caveat: a socket another thread of the process opens while a group is being built is recorded
too. Groups are built at start-up and in a recovery, while the training loop (the one thread
that uses the process groups) is not running; a training script's own thread that connects at
that moment would have its connection shut with the groups'.
"""

from __future__ import annotations

import functools
import os
import threading

import torch.distributed.distributed_c10d as c10d

_HELPER = "_new_process_group_helper"
_lock = threading.Lock()
_inodes: set[str] = set()


def socket_inodes() -> set[str]:
    """The inodes of this process's open sockets (Linux /proc/self/fd; elsewhere none)."""
    found = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            found.add(link[len("socket:[") : -1])
    return found


def install() -> bool:
    """Record the sockets of every group made from now on (idempotent); False when this torch
    has no such function to wrap."""
    helper = getattr(c10d, _HELPER, None)
    if helper is None:
        return False
    if getattr(helper, "records_sockets", False):
        return True

    @functools.wraps(helper)
    def recording(*args, **kwargs):
        with _lock:
            before = socket_inodes()
            try:
                return helper(*args, **kwargs)
            finally:
                _inodes.update(socket_inodes() - before)

    recording.records_sockets = True
    setattr(c10d, _HELPER, recording)
    return True


def take() -> set[str]:
    """The recorded inodes, forgotten here: the groups they belong to are being left for good
    (the groups made after that are recorded afresh)."""
    with _lock:
        taken = set(_inodes)
        _inodes.clear()
    return taken
