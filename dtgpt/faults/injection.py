"""Deliberate faults (`[faults]`) for the fault-tolerance tests and `scripts/fault_drill.py`.

A fault hits one rank at one iteration: SIGKILL (mid-iteration, inside the optimizer step, or
during a checkpoint save; several ranks at once, or a second one later), a hang, a SIGTERM/SIGINT
to itself, a full disk while a checkpoint is written, or an error raised in the model's forward
(a bug, from that iteration on). Each fires on the first attempt only: a group that torchrun restarted
(`Runtime.restart_count > 0`) runs clean, which is what lets a drill check that the restarted
job recovers. `nan_at_iterations`
makes the model's outputs non-finite in those iterations (on every attempt).

The training loop and the Checkpointer see one hook object: `NO_FAULTS`, whose hooks do
nothing, unless `[faults]` sets something. The train step itself knows nothing of faults.

Every fault prints a `fault:` line before it acts, so a log shows what was injected where.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

from torch.distributed.checkpoint import FileSystemWriter

from dtgpt.config import FaultsConfig


SAVE_KILL_WAIT_S = 600  # longest a rank waits at the next iteration for its async save's thread to kill it


def _announce(message: str) -> None:
    print(f"fault: {message}", flush=True)


def _kill(rank: int, where: str) -> None:
    _announce(f"SIGKILL to rank {rank} {where}")
    os.kill(os.getpid(), signal.SIGKILL)


class FaultHooks:
    """Where faults attach: around an iteration, and the writer of a checkpoint save. No-ops."""

    @contextlib.contextmanager
    def iteration(self, iteration: int, model_parts: list, optimizers: list = ()) -> Iterator[None]:
        """Wraps the train step of `iteration` (batch read included) over `model_parts` (nn.Modules)
        and their `optimizers`."""
        yield

    def storage_writer(self, directory: Path, iteration: int) -> FileSystemWriter | None:
        """A DCP writer for the save of `iteration`; None for DCP's own."""
        return None


NO_FAULTS = FaultHooks()


def build_faults(cfg: FaultsConfig, rank: int, restart_count: int, store=None) -> FaultHooks:
    """The hooks of `[faults]` for this rank: NO_FAULTS when the section is left at its defaults.
    `store`: this attempt's (Runtime.store), where ranks killed together meet first."""
    return NO_FAULTS if cfg == FaultsConfig() else Faults(cfg, rank, restart_count, store)


@contextlib.contextmanager
def _hooks_held(handles: list) -> Iterator[None]:
    """The hooks behind `handles` stay registered for the block, then are removed."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _non_finite_outputs(modules: list) -> contextlib.AbstractContextManager:
    """Every module's output times NaN, as a diverging step gives: loss and gradients non-finite."""
    return _hooks_held([m.register_forward_hook(lambda _m, _args, out: out * float("nan")) for m in modules])


def _killed_in_step(optimizers: list, die, iteration: int) -> contextlib.AbstractContextManager:
    """`die` once the first of `optimizers` has stepped: parameters changed, the iteration unrecorded."""
    kill = lambda *_: die(f"inside the optimizer step of iteration {iteration}")  # noqa: E731
    return _hooks_held([optimizer.register_step_post_hook(kill) for optimizer in optimizers])


def _kill_in_evaluation(modules: list, die, iteration: int) -> None:
    """`die` at the first forward in eval mode (the evaluation after `iteration`)."""

    def kill(module, _args):
        if not module.training:
            die(f"in the evaluation after iteration {iteration}")

    for module in modules:
        module.register_forward_pre_hook(kill)


def _raising(modules: list, iteration: int) -> contextlib.AbstractContextManager:
    """The modules' forward raises a plain RuntimeError (what a bug in the model looks like)."""

    def fail(*_):
        _announce(f"RuntimeError in the forward of iteration {iteration}")
        raise RuntimeError(f"injected bug in the model's forward (iteration {iteration})")

    return _hooks_held([module.register_forward_pre_hook(fail) for module in modules])


class Faults(FaultHooks):
    """The faults of `cfg` that apply to this rank, on this attempt."""

    def __init__(self, cfg: FaultsConfig, rank: int, restart_count: int, store=None):
        self.cfg, self.rank, self.store = cfg, rank, store
        self.armed = restart_count == 0
        self.killed_by_save = threading.Event()  # set while a save's writer is due to kill this rank (async: from its thread)

    def _hits(self, at_iteration: int, rank: int, iteration: int) -> bool:
        return self.armed and at_iteration > 0 and at_iteration == iteration and rank == self.rank

    def _die(self, where: str) -> None:
        """SIGKILL this rank as kill_at_iteration says, once every rank it kills is here too."""
        self._meet(f"dtgpt/faults/killed/{self.cfg.kill_at_iteration}")
        _kill(self.rank, where)

    def _meet(self, key: str) -> None:
        """A store barrier of the ranks one fault kills together (kill_rank and kill_also_ranks):
        they then die within milliseconds of each other, whatever the machine's load, so the
        launcher sees one event (its settle time is 1 s) and the survivors recover once."""
        together = {self.cfg.kill_rank, *self.cfg.kill_also_ranks}
        if len(together) < 2 or self.store is None:
            return
        if self.store.add(key, 1) == len(together):
            self.store.set(f"{key}/met", "1")
        self.store.wait([f"{key}/met"])

    def _killed(self, iteration: int) -> bool:
        c = self.cfg
        return self._hits(c.kill_at_iteration, c.kill_rank, iteration) or (
            self.rank in c.kill_also_ranks and self._hits(c.kill_at_iteration, self.rank, iteration)
        )

    @contextlib.contextmanager
    def iteration(self, iteration: int, model_parts: list, optimizers: list = ()) -> Iterator[None]:
        self.in_iteration(iteration)
        poisoned = model_parts if iteration in self.cfg.nan_at_iterations else []
        c = self.cfg
        in_step = optimizers[:1] if self._killed(iteration) and c.kill_during_step else []
        raising = model_parts[:1] if c.raise_at_iteration and iteration >= c.raise_at_iteration and self.rank == c.raise_rank else []
        with _non_finite_outputs(poisoned), _killed_in_step(in_step, self._die, iteration), _raising(raising, iteration):
            yield
        if self._killed(iteration) and c.kill_after_step:
            self._die(f"after the step of iteration {iteration}")
        if self._killed(iteration) and c.kill_during_eval:
            _kill_in_evaluation(model_parts[:1], self._die, iteration)

    def in_iteration(self, iteration: int) -> None:
        """Kill, signal or hang at the start of `iteration`, before its batch is read."""
        c = self.cfg
        if self.killed_by_save.is_set():
            # An async save's thread has yet to kill this rank: the main thread waits for it here, so
            # the death falls in the iteration after the save however slowly the thread writes. The
            # writer clears the event if its write fails first; the bound keeps a save that never
            # reaches the writer (a peer's failure) from hanging the rank.
            deadline = time.monotonic() + SAVE_KILL_WAIT_S
            while self.killed_by_save.is_set() and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.killed_by_save.is_set():
                _announce(f"rank {self.rank} was not killed by its save within {SAVE_KILL_WAIT_S} s; training on")
            self.killed_by_save.clear()
        if self._killed(iteration) and not (c.kill_during_save or c.kill_during_step or c.kill_after_step or c.kill_during_eval):
            self._die(f"in iteration {iteration}")
        if self._hits(c.kill_again_at_iteration, c.kill_again_rank, iteration):
            _kill(self.rank, f"in iteration {iteration}")
        if self._hits(c.signal_at_iteration, c.signal_rank, iteration):
            _announce(f"{c.signal_name} to rank {self.rank} in iteration {iteration}")
            os.kill(os.getpid(), getattr(signal, c.signal_name))
        if self._hits(c.hang_at_iteration, c.hang_rank, iteration):
            _announce(f"rank {self.rank} hangs in iteration {iteration}")
            while True:
                time.sleep(3600)

    def storage_writer(self, directory: Path, iteration: int) -> FileSystemWriter | None:
        """A DCP writer that fails as configured in the save of `iteration`; None for DCP's own."""
        c = self.cfg
        if self._killed(iteration) and c.kill_during_save:
            action = "kill"
            self.killed_by_save.set()
        elif self._hits(c.disk_full_at_iteration, c.disk_full_rank, iteration):
            action = "disk_full"
        elif self._hits(c.signal_at_iteration, c.signal_rank, iteration):
            action = "signal"
        else:
            return None
        from dtgpt.faults.faulty_writer import FaultyWriter  # here: dtgpt.checkpoint imports this module

        return FaultyWriter(directory, action=action, rank=self.rank, iteration=iteration, failed=self.killed_by_save.clear)
