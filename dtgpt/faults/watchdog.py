"""Make stalls visible: a heartbeat line when an iteration runs far longer than usual.

A background thread watches the phase the trainer is in. When the current phase has run longer
than `factor` times the running median iteration time (and at least `min_seconds`), it prints
which rank is waiting in which phase of which iteration, and repeats every `min_seconds` until
the phase ends. A dead or stuck peer then shows up in the log long before the collective
timeout (`distributed.timeout_minutes`) turns it into an error.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Callable


class Watchdog:
    def __init__(
        self, rank: int, factor: float, min_seconds: float = 30.0, window: int = 50, clock: Callable[[], float] = time.monotonic
    ):
        """`clock`: seconds, monotonic (a test passes its own, so no phase's length depends on the machine's speed)."""
        self.rank = rank
        self.clock = clock
        self.factor = factor
        self.min_seconds = min_seconds
        self._durations: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._iteration = 0
        self._started = 0.0
        self._last_beat = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if factor > 0:
            self._thread = threading.Thread(target=self._run, name="dtgpt-watchdog", daemon=True)
            self._thread.start()

    def enter(self, phase: str, iteration: int) -> None:
        with self._lock:
            self._phase, self._iteration, self._started = phase, iteration, self.clock()
            self._last_beat = self._started

    def leave(self, record: bool = False) -> None:
        with self._lock:
            if record and self._phase is not None:
                self._durations.append(self.clock() - self._started)
            self._phase = None

    def limit(self) -> float | None:
        """Seconds after which the current phase counts as stalled (None before enough history)."""
        with self._lock:
            if len(self._durations) < 3:
                return None
            return max(self.factor * statistics.median(self._durations), self.min_seconds)

    def check(self, now: float | None = None) -> str | None:
        """The heartbeat line due now, if any (the thread calls this once a second)."""
        limit = self.limit()
        now = self.clock() if now is None else now
        with self._lock:
            if self._phase is None or limit is None:
                return None
            running = now - self._started
            if running < limit or now - self._last_beat < min(limit, self.min_seconds):
                return None
            self._last_beat = now
            median = statistics.median(self._durations)
            return (
                f"heartbeat: rank {self.rank} has been in '{self._phase}' of iteration {self._iteration} "
                f"for {running:.0f} s (median iteration {median:.2f} s); a peer may be stuck or dead"
            )

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            line = self.check()
            if line:
                print(line, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
