"""The workers of one node as one process context each, so that one of them can be replaced alone.

torch's `start_processes` makes one `PContext` for all local workers, and that context stops
them all as soon as any fails. `WorkerProcesses` makes one context per worker instead (each the
standard `start_processes` of one process) and offers the agent what it uses of a `PContext`
(`pids`, `wait`, `close`), plus `failures` and `respawn` for a single worker.

Each context logs its worker's failure as local rank 0 (its only process); that line is dropped
(`_OwnFailureLines`), and the agent says it with the worker's ranks (dtgpt/run/agent.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, PContext, RunProcsResult
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dtgpt.run.keys import LAUNCHER_ENV, LAUNCHER_NAME

TORCH_PROCESS_LOG = "torch.distributed.elastic.multiprocessing.api"


class _OwnFailureLines(logging.Filter):
    """Drops a one-process context's "failed (exitcode: ...) local_rank: 0 (pid: ...)" line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode:")


_FAILURE_LINES = _OwnFailureLines()


class OneWorkerLogs(LogsSpecs):
    """Local rank `local_rank`'s part of the node's log destinations, as the only worker (key 0).

    The node's destinations are made once per round (torch's `reify` empties the attempt's log
    directory, so it cannot run once per worker); a replacement writes to its predecessor's files.
    """

    def __init__(self, node_dest: LogsDest, local_rank: int, root_log_dir: str):
        super().__init__(log_dir=root_log_dir)
        self._dest = node_dest
        self._local_rank = local_rank

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        def mine(paths: dict[int, str]) -> dict[int, str]:
            return {0: paths[self._local_rank]} if self._local_rank in paths else {}

        dest = self._dest
        return LogsDest(
            stdouts=mine(dest.stdouts), stderrs=mine(dest.stderrs), tee_stdouts=mine(dest.tee_stdouts),
            tee_stderrs=mine(dest.tee_stderrs), error_files=mine(dest.error_files),
            filtered_stdout=dest.filtered_stdout, filtered_stderr=dest.filtered_stderr,
        )  # fmt: skip


class WorkerProcesses:
    """One node's workers, each in a context of its own; built from `start_processes`' keyword arguments."""

    def __init__(self, **start_args: Any):
        self._start_args = start_args
        logs_specs: LogsSpecs = start_args["logs_specs"]
        self._node_dest = logs_specs.reify(start_args["envs"])
        self._root_log_dir = logs_specs.root_log_dir
        self._contexts: dict[int, PContext] = {}
        logging.getLogger(TORCH_PROCESS_LOG).addFilter(_FAILURE_LINES)  # once: filters are a set
        self._ended: dict[int, RunProcsResult] = {}
        for local_rank in sorted(start_args["args"]):
            self._contexts[local_rank] = self._start(local_rank, {})

    def _start(self, local_rank: int, extra_env: dict[str, str]) -> PContext:
        start = self._start_args
        env = {**start["envs"][local_rank], LAUNCHER_ENV: LAUNCHER_NAME, **extra_env}
        prefixes = start.get("log_line_prefixes")
        # without a prefix of its own, torch would label the worker with its key in its context (0)
        prefix = prefixes[local_rank] if prefixes else f"[{start['name']}{local_rank}]:"
        context = start_processes(
            name=start["name"], entrypoint=start["entrypoint"], args={0: start["args"][local_rank]},
            envs={0: env}, logs_specs=OneWorkerLogs(self._node_dest, local_rank, self._root_log_dir),
            log_line_prefixes={0: prefix}, start_method=start["start_method"],
            numa_options=start.get("numa_options"),
            duplicate_stdout_filters=start.get("duplicate_stdout_filters"),
            duplicate_stderr_filters=start.get("duplicate_stderr_filters"),
        )  # fmt: skip
        return context

    def pids(self) -> dict[int, int]:
        return {local_rank: context.pids()[0] for local_rank, context in self._contexts.items()}

    def running(self) -> set[int]:
        self._poll()
        return set(self._contexts) - set(self._ended)

    def failures(self) -> dict[int, ProcessFailure]:
        """The workers that have failed since they (or their replacements) started, by local rank."""
        self._poll()
        return {
            local_rank: result.failures[0] for local_rank, result in self._ended.items() if result.is_failed()
        }  # fmt: skip

    def _poll(self) -> None:
        for local_rank, context in self._contexts.items():
            if local_rank not in self._ended:
                result = context.wait(0)
                if result is not None:
                    for failure in result.failures.values():
                        failure.local_rank = local_rank  # its context calls it 0
                    self._ended[local_rank] = result

    def respawn(self, local_rank: int, extra_env: dict[str, str]) -> int:
        """Start a new process for `local_rank` (which has ended); returns its pid."""
        self._contexts[local_rank].close()
        error_file = self._node_dest.error_files.get(local_rank)
        if error_file and os.path.isfile(error_file):
            os.remove(error_file)  # its content is in the failure already; the new process writes its own
        del self._ended[local_rank]
        self._contexts[local_rank] = self._start(local_rank, extra_env)
        return self._contexts[local_rank].pids()[0]

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """As a `PContext`: once any worker has failed, stop the others and return every failure;
        once all have exited 0, success; otherwise (after `timeout` seconds; < 0: none) None."""
        deadline = time.monotonic() + timeout if timeout >= 0 else float("inf")
        while True:
            failures = self.failures()
            if failures:
                self.close()
                return RunProcsResult(failures={**failures, **self.failures()})
            if len(self._ended) == len(self._contexts):
                return RunProcsResult(return_values=dict.fromkeys(self._contexts))
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(period, max(deadline - time.monotonic(), 0)))

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        """Stop every worker as one `PContext` would: all get `death_sig` at once, and one shared
        `timeout` before SIGKILL (each context closes in a thread of its own)."""
        threads = [
            threading.Thread(target=context.close, args=(death_sig, timeout), daemon=True)
            for context in self._contexts.values()
        ]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
