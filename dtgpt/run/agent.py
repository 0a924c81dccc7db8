"""torch's `LocalElasticAgent`, except that a single failed worker is replaced alone.

The agent runs torchrun's loop unchanged (`SimpleElasticAgent._invoke_run`: rendezvous, monitor
every `--monitor-interval` seconds, full restart or stop on failure, exit barrier). Two of its
steps are specialised:

- `_start_workers` starts each local worker in a process context of its own
  (dtgpt/run/workers.py), with torch's own environment for it;
- `_monitor_workers` looks at failures first, once no other worker has failed for `SETTLE_S`
  (ranks killed together, a whole replica say, are one event):
  - a failed worker that never started its first iteration (no `started` key), or a job that
    training asked to stop (the `stop` key: a bug, which a restart repeats): no replacement and
    no restart; the launcher stops every worker and exits with the failed worker's exit code
    (`StoppedOnError`), without torch's failure report (the worker said what failed); the others
    may run on up to `STOP_GRACE_S` to end by themselves;
  - failed workers while every other local worker runs, a restart is left, no earlier replacement
    on this node is still joining, and the workers share the agent's store: it posts
    `dtgpt/launcher/replacing/<rank>` for each and starts the replacements, with the same
    environment plus `DTGPT_REPLACEMENT=<n>`; the survivors keep their processes (training then
    decides whether it can recover; if not, its workers fail and the next case applies);
  - anything else is torchrun's behaviour: post `no_replacement` for each failed rank, stop
    every worker, restart them all in a new rendezvous round while restarts remain.

Each failure is one line of the agent's, naming the global rank, the local rank and the pid
(torch's per-process line is dropped: each worker's process context calls it local rank 0).
Replacements (of one worker or several at once) and full restarts draw on the same `--max-restarts`.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dtgpt.run.keys import (
    DEATHS_KEY,
    REPLACEMENT_ENV,
    STOP_KEY,
    no_replacement_key,
    recovered_key,
    replacing_key,
    started_key,
)
from dtgpt.run.workers import WorkerProcesses

log = logging.getLogger("dtgpt.run")
STORE_TIMEOUT = timedelta(seconds=30)
SETTLE_S = 1.0
"""How long the agent waits after a failure for others before it acts: ranks that die together
(a whole replica, one machine's processes) are replaced together, in one recovery."""
STOP_GRACE_S = 30.0
"""How long the agent lets the other workers run on after one failed at start-up or training
asked it to stop: under load they reach the same config error seconds apart (rank 0 is the one
that prints it), and the rank that raised a bug prints its traceback after last words."""
USAGE_ERROR = 2
"""A worker's exit code after its one-line `error:` (dtgpt/cli.py): nothing to add to it."""


class StoppedOnError(SystemExit):
    """The job stopped on an error a restart would repeat; its code is the failed worker's exit code."""


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
        self._first_failure_at: float | None = None
        self._settled_from, self._seen_failures = 0.0, 0
        self._stopped: tuple[str, int] | None = None  # (why, exit code): stop, no restart

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._replacements, self._joining = {}, {}
        self._first_failure_at, self._seen_failures = None, 0
        self._shared_store = None  # a new round may have a new master address
        with _each_worker_apart():
            return super()._start_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        super()._stop_workers(worker_group)
        self._clear_keys()

    def run(self, role: str = "default") -> RunResult:
        result = super().run(role)
        if self._stopped is not None and result is not None and result.is_failed():
            why, code = self._stopped
            if code != USAGE_ERROR:
                print(f"python -m dtgpt.run: {why}; the job is stopped, not restarted", flush=True)
            raise StoppedOnError(code)
        return result

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        processes = self._pcontext
        if isinstance(processes, WorkerProcesses):
            failures = processes.failures()
            if failures and self._stopped is None:
                now = time.monotonic()
                if self._first_failure_at is None:
                    self._first_failure_at = now
                if len(failures) > self._seen_failures:
                    self._settled_from, self._seen_failures = now, len(failures)
                if now - self._settled_from < SETTLE_S and processes.running():
                    return RunResult(state=WorkerState.HEALTHY)  # others may be failing too
                stop = self._stop_reason(worker_group, failures)
                if stop is not None and processes.running() and now - self._first_failure_at < STOP_GRACE_S:
                    return RunResult(state=WorkerState.HEALTHY)  # the others are on their way out (or to the same error)
                self._first_failure_at, self._seen_failures = None, 0
                if stop is not None:
                    self._stop(worker_group, failures, stop)
                elif self._may_replace(worker_group, processes, failures):
                    self._replace(worker_group, processes, failures)
                    return RunResult(state=WorkerState.HEALTHY)
                else:
                    self._announce_no_replacement(worker_group, failures)
        return super()._monitor_workers(worker_group)

    def _stop_reason(self, group: WorkerGroup, failures: dict[int, ProcessFailure]) -> str | None:
        """Why the job must stop instead of being replaced or restarted, or None."""
        store = self._workers_store()
        if store is None:
            return None
        if store.check([STOP_KEY]):
            return store.get(STOP_KEY).decode()
        for local_rank, failure in sorted(failures.items()):
            rank = group.workers[local_rank].global_rank
            if not store.check([started_key(rank)]):
                return f"rank {rank} failed before its first iteration (exit code {failure.exitcode})"
        return None

    def _stop(self, group: WorkerGroup, failures: dict[int, ProcessFailure], why: str) -> None:
        first = min(failures.values(), key=lambda failure: failure.timestamp)
        code = first.exitcode if first.exitcode > 0 else 1
        if code != USAGE_ERROR:
            self._log_failures(group, failures, "no replacement, no restart")
        self._stopped = (why, code)
        self._remaining_restarts = 0
        for local_rank in failures:
            self._set_key(no_replacement_key(group.workers[local_rank].global_rank), why)

    def _log_failures(self, group: WorkerGroup, failures: dict[int, ProcessFailure], then: str) -> None:
        for local_rank, failure in sorted(failures.items()):
            worker = group.workers[local_rank]
            log.warning(
                "[%s] worker %s (local rank %s, pid %s) failed (exitcode %s); %s",
                group.spec.role, worker.global_rank, local_rank, failure.pid, failure.exitcode, then,
            )  # fmt: skip

    def _may_replace(self, group: WorkerGroup, processes: WorkerProcesses, failures: dict[int, ProcessFailure]) -> bool:
        if self._remaining_restarts <= 0:
            return False
        if processes.running() != set(range(group.spec.local_world_size)) - set(failures):
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

    def _replace(self, group: WorkerGroup, processes: WorkerProcesses, failures: dict[int, ProcessFailure]) -> None:
        """Replace every failed worker, each with its rank; one restart for them all."""
        self._remaining_restarts -= 1
        self._post_deaths()
        for local_rank, failure in sorted(failures.items()):
            worker = group.workers[local_rank]
            number = self._replacements.get(local_rank, 0) + 1
            log.warning(
                "[%s] worker %s (local rank %s, pid %s) failed (exitcode %s); starting replacement %s "
                "with the same rank, the other workers keep running; %s/%s restarts left",
                group.spec.role, worker.global_rank, local_rank, failure.pid, failure.exitcode, number,
                self._remaining_restarts, group.spec.max_restarts,
            )  # fmt: skip
            self._set_key(replacing_key(worker.global_rank), str(number))
        for local_rank in sorted(failures):
            worker = group.workers[local_rank]
            number = self._replacements.get(local_rank, 0) + 1
            worker.id = processes.respawn(local_rank, {REPLACEMENT_ENV: str(number)})
            self._replacements[local_rank] = number
            self._joining[worker.global_rank] = number

    def _announce_no_replacement(self, group: WorkerGroup, failures: dict[int, ProcessFailure]) -> None:
        if self._remaining_restarts <= 0:
            reason = "restarts exhausted"
        else:
            reason = "the job cannot continue with a replacement; restarting all"
        self._log_failures(group, failures, f"no replacement ({reason})")
        self._post_deaths()
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

    def _post_deaths(self) -> None:
        """Tell every survivor at once (their failure watch leaves its collectives)."""
        store = self._workers_store()
        if store is not None:
            store.add(DEATHS_KEY, 1)
            self._keys_set.append(DEATHS_KEY)

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
            for worker in self._worker_group.workers:  # the next round's workers start afresh
                store.delete_key(started_key(worker.global_rank))
            store.delete_key(STOP_KEY)
        self._keys_set = []
