"""The save on a signal: when to stop early, and save, on a signal (Slurm preemption, Ctrl-C), a
time budget, or an iteration multiple.

Every rank must stop at the same iteration, so each decision is all-reduced with MAX: if any
rank saw a signal or ran out of time, all stop after the current iteration, which the trainer
then saves. (The survivors' save after a hard failure, "last words", is last_words.py.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import torch
import torch.distributed as dist

from dtgpt.config import CheckpointConfig


def signal_handler_enabled(cfg: CheckpointConfig) -> bool:
    """checkpoint.exit_signal_handler, which when unset means "on whenever there is a save"."""
    return bool(cfg.save) if cfg.exit_signal_handler is None else cfg.exit_signal_handler


DEFAULT_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_signals(cfg: CheckpointConfig) -> tuple[signal.Signals, ...]:
    """The signals the handler catches: checkpoint.exit_signal alone (Megatron's --exit-signal), or
    SIGTERM and SIGINT when it is unset."""
    return (signal.Signals[cfg.exit_signal],) if cfg.exit_signal else DEFAULT_EXIT_SIGNALS


class SignalFlag:
    """Record the exit signals (SIGTERM/SIGINT by default) instead of dying; a second one while
    saving is ignored too."""

    def __init__(self, enabled: bool, announce: bool = True, signals: tuple[signal.Signals, ...] = DEFAULT_EXIT_SIGNALS):
        """`announce`: print what was received (one rank does: Ctrl-C reaches every rank at once)."""
        self.enabled, self.announce = enabled, announce
        self.received: int | None = None
        self._previous = {}
        if enabled:
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            message = f"received signal {name}: finishing this iteration, then saving\n"
        else:
            message = f"received signal {name} again: ignored, already finishing and saving\n"
        # os.write, not print: the main thread may be inside a print to stdout, and a buffered
        # stream raises "reentrant call" when a signal handler writes to it then.
        if self.announce:
            with contextlib.suppress(OSError):
                os.write(1, message.encode())
        self.received = self.received or signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class ExitConditions:
    def __init__(self, cfg: CheckpointConfig, device: torch.device, announce: bool = True):
        self.cfg = cfg
        self.device = device
        self.start = time.monotonic()
        self.signals = SignalFlag(signal_handler_enabled(cfg), announce, exit_signals(cfg))

    def reason(self, iteration: int) -> str | None:
        """Why training should stop after `iteration`, agreed across ranks; None to go on."""
        c = self.cfg
        if c.exit_interval and iteration % c.exit_interval == 0:
            return f"exit_interval={c.exit_interval} reached at iteration {iteration}"
        checks = []
        if self.signals.enabled:
            checks.append(("signal", self.signals.received is not None))
        if c.exit_duration_in_mins:
            elapsed = (time.monotonic() - self.start) / 60.0
            checks.append(("duration", elapsed > c.exit_duration_in_mins))
        if not checks:
            return None
        # One collective for both checks; values are flags, so MAX means "any rank".
        flags = torch.tensor([1.0 if hit else 0.0 for _, hit in checks], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for (name, _), hit in zip(checks, flags.tolist()):
            if hit > 0:
                if name == "signal":
                    return "exit signal received"
                return f"exit_duration_in_mins={c.exit_duration_in_mins} exceeded"
        return None

    def close(self) -> None:
        self.signals.restore()
