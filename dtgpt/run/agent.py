"""torch's `LocalElasticAgent`, except that a single failed worker is replaced alone.

The agent runs torchrun's loop unchanged (`SimpleElasticAgent._invoke_run`: rendezvous, monitor
every `--monitor-interval` seconds, full restart or stop on failure, exit barrier). Two of its
steps are specialised:

- `_start_workers` starts each local worker in a process context of its own
  (dtgpt/run/workers.py), with torch's own environment for it;
- `_monitor_workers` looks at failures first. One worker failed while every other local worker
  runs, a restart is left, no earlier replacement on this node is still joining, and the
  workers share the agent's store: it posts `dtgpt/launcher/replacing/<rank>` and starts the
  replacement, with the same environment plus `DTGPT_REPLACEMENT=<n>`; the survivors keep their
  processes. Anything else is torchrun's behaviour: post `no_replacement` for each failed rank,
  stop every worker, restart them all in a new rendezvous round while restarts remain.

Replacements and full restarts draw on the same `--max-restarts`.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dtgpt.run.keys import REPLACEMENT_ENV, no_replacement_key, recovered_key, replacing_key
from dtgpt.run.workers import WorkerProcesses

log = logging.getLogger("dtgpt.run")
STORE_TIMEOUT = timedelta(seconds=30)


@contextmanager
def _each_worker_apart():
    """torch's agent calls the module's `start_processes` once for all workers; during its
    `_start_workers` that call makes a `WorkerProcesses` instead (same arguments)."""
    original = local_elastic_agent.start_processes
    local_elastic_agent.start_processes = WorkerProcesses
    try:
        yield
    finally:
        local_elastic_agent.start_processes = original


class ReplacingAgent(local_elastic_agent.LocalElasticAgent):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._replacements: dict[int, int] = {}  # local rank -> replacements this round
        self._joining: dict[int, int] = {}  # global rank -> replacement not yet recovered
        self._keys_set: list[str] = []
        self._shared_store: dist.Store | None = None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._replacements, self._joining = {}, {}
        self._shared_store = None  # a new round may have a new master address
        with _each_worker_apart():
            return super()._start_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        super()._stop_workers(worker_group)
        self._clear_keys()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        processes = self._pcontext
        if isinstance(processes, WorkerProcesses):
            failures = processes.failures()
            if failures:
                if self._may_replace(worker_group, processes, failures):
                    self._replace(worker_group, processes, *next(iter(failures.items())))
                    return RunResult(state=WorkerState.HEALTHY)
                self._announce_no_replacement(worker_group, failures)
        return super()._monitor_workers(worker_group)

    def _may_replace(self, group: WorkerGroup, processes: WorkerProcesses, failures: dict[int, ProcessFailure]) -> bool:
        if len(failures) != 1 or self._remaining_restarts <= 0:
            return False
        (local_rank,) = failures
        if processes.running() != set(range(group.spec.local_world_size)) - {local_rank}:
            return False  # others have exited (0 or not): not a job a replacement can join
        return not self._still_joining() and self._workers_store() is not None

    def _still_joining(self) -> bool:
        """Whether a replacement started on this node has not yet been reported recovered by training."""
        store = self._workers_store()
        for rank, number in list(self._joining.items()):
            key = recovered_key(rank)
            if store is not None and store.check([key]) and int(store.get(key)) >= number:
                del self._joining[rank]
        return bool(self._joining)

    def _replace(self, group: WorkerGroup, processes: WorkerProcesses, local_rank: int, failure: ProcessFailure) -> None:
        worker = group.workers[local_rank]
        number = self._replacements.get(local_rank, 0) + 1
        self._remaining_restarts -= 1
        log.warning(
            "[%s] worker %s (local rank %s, pid %s) failed (exitcode %s); starting replacement %s "
            "with the same rank, the other workers keep running; %s/%s restarts left",
            group.spec.role, worker.global_rank, local_rank, failure.pid, failure.exitcode, number,
            self._remaining_restarts, group.spec.max_restarts,
        )  # fmt: skip
        self._set_key(replacing_key(worker.global_rank), str(number))
        worker.id = processes.respawn(local_rank, {REPLACEMENT_ENV: str(number)})
        self._replacements[local_rank] = number
        self._joining[worker.global_rank] = number

    def _announce_no_replacement(self, group: WorkerGroup, failures: dict[int, ProcessFailure]) -> None:
        if self._remaining_restarts <= 0:
            reason = "restarts exhausted"
        elif len(failures) > 1:
            reason = f"{len(failures)} workers failed; restarting all"
        else:
            reason = "the job cannot continue with a replacement; restarting all"
        for local_rank in failures:
            self._set_key(no_replacement_key(group.workers[local_rank].global_rank), reason)

    def _workers_store(self) -> dist.Store | None:
        """A client of the store the workers share (None when they do not use the agent's store:
        then a worker hosts it, and it may be the one that died)."""
        group = self._worker_group
        if self._shared_store is None and group.spec.rdzv_handler.use_agent_store:
            try:
                self._shared_store = dist.TCPStore(
                    group.master_addr, group.master_port, is_master=False, timeout=STORE_TIMEOUT
                )  # fmt: skip
            except (RuntimeError, ValueError) as error:
                log.warning("[%s] cannot reach the workers' store: %s", group.spec.role, error)
        return self._shared_store

    def _set_key(self, key: str, value: str) -> None:
        store = self._workers_store()
        if store is not None:
            store.set(key, value)
            self._keys_set.append(key)

    def _clear_keys(self) -> None:
        store = self._shared_store
        if store is not None:
            for key in self._keys_set:
                store.delete_key(key)
            for rank in self._joining:
                store.delete_key(recovered_key(rank))
        self._keys_set = []
