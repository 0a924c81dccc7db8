"""Last words after a hard failure: the survivors save the last completed iteration.

When a rank dies (SIGKILL, a segfault, an OOM kill), its peers' next collective fails ("Connection
closed by peer"); the first to fail posts a failure notice and every survivor leaves the
collective it is blocked in within a second (detect.py), and torchrun sends the survivors
SIGTERM and, after its `--shutdown-timeout` (30 s), SIGKILL. In that window the survivors:

1. **roll call**: each sets a key in this attempt's store (dtgpt/faults/attempt_store.py) with the last
   iteration it completed and whether it was inside the optimizer step; they wait until every
   rank has answered or `distributed.roll_call_seconds` passed, and the first to close the roll
   fixes the list of survivors for everyone (an atomic compare-and-set). No survivor is still
   blocked in a collective by then (detect.py), so each answers within the window;
2. **decide** (`decide`, a pure function): last words only when nobody was inside the optimizer
   step and all agree on the last completed iteration (the consistency rule: a failure during
   forward/backward leaves the last completed iteration's weights, optimizer moments, schedule
   and loss scale untouched, only gradients and the RNG moved, and the RNG is restored from the
   iteration's start; once an optimizer step has begun, parameters are a mix of two iterations),
   and when the survivors hold a complete copy of the state: every rank of at least one
   data-parallel replica is alive (with `data_parallel_replicate_size >= 2`; without replicas, a
   dead rank's shards exist nowhere else);
3. **save**: over a new gloo group of the survivors (`dist.new_group(..., use_local_synchronization=True)`;
   the training groups were left in step 1, and gloo cannot shrink a group) as a normal
   checkpoint, marker and pointer included. Each DTensor's local shard carries its global
   offset, and DCP keeps one copy of each shard that replicas hold twice, so the metadata
   describes whole tensors and the restart loads it at any mesh.

Otherwise one line says why not and which checkpoint the restart will use. The defaults fit
torchrun's: the roll call (10 s) plus one save of a small model inside its 30 s grace; a large
model's save needs `--shutdown-timeout` above the window plus one save (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from dtgpt.checkpoint import layout
from dtgpt.faults.detect import FailureDetector, summary
from dtgpt.parallel.dims import MESH_DIMS
from dtgpt.state import TrainState, rng_state

PREFIX = "last-words"


class InFlight:
    """What the training loop knows of the iteration it is in: the RNG state at its start
    (forward and backward draw dropout masks) and whether the optimizer step has begun, marked
    by a pre-hook on every optimizer, so the train step itself carries no marker."""

    def __init__(self, state: TrainState):
        self.state = state
        # Only a whole replica can save last words, so without replicas no snapshot is ever read.
        self.snapshots = state.model.dims.dp_replicate >= 2
        self.stepping = False
        self.rng: dict[str, torch.Tensor] | None = None
        """The generators at the start of the iteration in progress; None between iterations."""
        for optimizer in state.optimizer.optimizers:
            optimizer.register_step_pre_hook(self._step_begins)

    def _step_begins(self, _optimizer, _args, _kwargs) -> None:
        self.stepping = True

    def begin(self) -> None:
        """Before an iteration's batch is read (its state is then the last completed one's)."""
        self.stepping = False
        if self.snapshots:
            self.rng = {key: value.clone() for key, value in rng_state(self.state.model).items()}

    def end(self) -> None:
        """The iteration completed: its state, live generators included, is the last completed one."""
        self.stepping, self.rng = False, None


@dataclass
class Report:
    iteration: int
    """The last iteration this rank completed."""
    stepping: bool
    """It failed inside the optimizer step of the next one."""


def replicas(dims) -> list[list[int]]:
    """The global ranks of each data-parallel replica (one dp_replicate coordinate each)."""
    dim = MESH_DIMS.index("dp_replicate")
    return [dims.mesh.mesh.select(dim, r).flatten().tolist() for r in range(dims.dp_replicate)]


def consistent(reports: dict[int, Report]) -> tuple[int | None, str]:
    """(the last completed iteration every survivor holds intact, or None; why not): the consistency rule."""
    if any(r.stepping for r in reports.values()):
        stepping = sorted(rank for rank, r in reports.items() if r.stepping)
        return None, f"rank {stepping[0]} was inside the optimizer step, so no iteration is intact"
    completed = {r.iteration for r in reports.values()}
    if len(completed) > 1:
        return None, f"the survivors completed different iterations {sorted(completed)}"
    return completed.pop(), ""


def decide(reports: dict[int, Report], replica_ranks: list[list[int]]) -> tuple[int | None, str]:
    """(the iteration the survivors can save, or None; why not). `reports` holds the survivors."""
    iteration, why = consistent(reports)
    if iteration is None:
        return None, why
    whole = [ranks for ranks in replica_ranks if all(rank in reports for rank in ranks)]
    if not whole:
        dead = sorted({rank for ranks in replica_ranks for rank in ranks} - set(reports))
        return None, f"no replica of the model and optimizer is whole without rank(s) {dead}"
    return iteration, ""


def roll_call(
    store: dist.Store, rank: int, world_size: int, report: Report, seconds: float, known_dead: Callable[[], int] = lambda: 0
) -> dict[int, Report] | None:
    """Every survivor's report, the same on each; None for a rank that answered after the roll closed.
    `known_dead()`: how many ranks are known to be gone (the launcher says so), who need not be waited for."""
    store.set(f"{PREFIX}/report/{rank}", json.dumps(report.__dict__))
    store.add(f"{PREFIX}/answered", 1)
    deadline = time.monotonic() + seconds
    while store.add(f"{PREFIX}/answered", 0) + known_dead() < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    present = [r for r in range(world_size) if store.check([f"{PREFIX}/report/{r}"])]
    # The first rank to get here fixes the roll; everyone else reads that one.
    roll = json.loads(store.compare_set(f"{PREFIX}/roll", "", json.dumps(present)))
    if rank not in roll:
        return None
    return {r: Report(**json.loads(store.get(f"{PREFIX}/report/{r}"))) for r in roll}


def speak(
    state: TrainState, checkpointer, store: dist.Store, inflight: InFlight, seconds: float,
    known_dead: Callable[[], int] = lambda: 0,
) -> dict[int, Report] | None:  # fmt: skip
    """After a failed collective in the train step (and detect.py's leave): roll call, decide,
    save or say why not. `known_dead`: as roll_call's. Returns the roll (None: no roll call, or
    this rank missed it), which tells whether a rank died."""
    dims, rank = state.model.dims, dist.get_rank()
    if dims.dp_replicate < 2:  # no rank's shards exist twice: nothing to wait for
        if store.compare_set(f"{PREFIX}/speaker", "", str(rank)) == str(rank).encode():  # one line, from the first
            _none(checkpointer, "no replicas: parallel.data_parallel_replicate_size=1, so a dead rank's shards are lost")
        return None
    report = Report(state.progress.iteration, inflight.stepping)
    reports = roll_call(store, rank, dims.world_size, report, seconds, known_dead)
    if reports is None:
        print(f"last words: rank {rank} answered the roll call too late; it saves nothing", flush=True)
        return None
    speaker = rank == min(reports)
    checkpointer.wait()  # a background save in flight ends first (it fails, or it completes)
    iteration, why = decide(reports, replicas(dims))
    if iteration is not None and not checkpointer.saved(iteration):
        # gloo whatever the training backend: on NCCL the groups were just aborted, and a new
        # NCCL communicator could be split from an aborted one.
        group = dist.new_group(sorted(reports), backend="gloo", use_local_synchronization=True)
        start = time.perf_counter()
        directory = checkpointer.save_over(iteration, group, inflight.rng)
        if speaker:
            print(f"last words: ranks {sorted(reports)} saved iteration {iteration} to {directory} in "
                  f"{time.perf_counter() - start:.2f} s after a hard failure", flush=True)  # fmt: skip
    elif speaker:
        _none(checkpointer, why or f"iteration {iteration} is saved already")
    return reports


def _none(checkpointer, why: str) -> None:
    pointed = layout.read_pointer(checkpointer.cfg.save)
    restart = f"iteration {pointed}" if pointed is not None else "no checkpoint (from scratch)"
    print(f"last words: none ({why}); the restart resumes from {restart}", flush=True)


class IterationWatch:
    """What wraps each train step: remember its start (`inflight`), and handle a failed
    collective in `guard` (each subclass its own way)."""

    inflight: InFlight

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        self.inflight.begin()
        with self.guard():
            yield
        self.inflight.end()

    def guard(self, phase: str = "") -> contextlib.AbstractContextManager:
        raise NotImplementedError


class LastWords(IterationWatch):
    """Wraps each train step, remembering its start (InFlight), and the stop decision after it
    (its all-reduce is where survivors of a rank that died in the optimizer step fail); when a
    collective in either fails, declares the failure (detect.py) and speaks."""

    def __init__(self, state: TrainState, checkpointer, detector: FailureDetector, seconds: float):
        self.state, self.checkpointer, self.detector, self.seconds = state, checkpointer, detector, seconds
        self.inflight = InFlight(state)

    @contextlib.contextmanager
    def guard(self, phase: str = "") -> Iterator[None]:
        """`phase`: as recovery.Recovery.guard's (last words treat every phase alike)."""
        try:
            yield
        except (RuntimeError, OSError) as e:
            if peer_failure(e):
                self.detector.declare(summary(e))
                speak(self.state, self.checkpointer, self.detector.store, self.inflight, self.seconds)
            raise

    def close(self) -> None:
        self.detector.close()


def peer_failure(e: BaseException) -> bool:
    """Whether `e` may be a failed collective: gloo reports a dead peer and a timeout as a plain
    RuntimeError; dtgpt's own errors (bad data, a non-finite loss) subclass it and are no
    hard failure of a peer. A bug can raise a plain RuntimeError too: whether a peer died is
    the launcher's to say (recovery.py), never this function's."""
    return type(e) in (RuntimeError, OSError) or isinstance(e, dist.DistError)


class Silent:
    """No last words: one process, no checkpoint.save, or distributed.roll_call_seconds = 0. A
    failed collective still declares the failure, so that no peer waits for its timeout."""

    def __init__(self, detector: FailureDetector | None = None):
        self.detector = detector

    def iteration(self) -> contextlib.AbstractContextManager:
        return self.guard()

    @contextlib.contextmanager
    def guard(self, phase: str = "") -> Iterator[None]:
        try:
            yield
        except (RuntimeError, OSError) as e:
            if self.detector is not None and peer_failure(e):
                self.detector.declare(summary(e))
            raise

    def close(self) -> None:
        if self.detector is not None:
            self.detector.close()


def build_last_words(cfg, runtime, state: TrainState, checkpointer) -> LastWords | Silent:
    detector = FailureDetector(runtime.store, runtime.rank) if runtime.store is not None and runtime.world_size > 1 else None
    if detector is None or checkpointer is None or not cfg.checkpoint.save or cfg.distributed.roll_call_seconds <= 0:
        return Silent(detector)
    return LastWords(state, checkpointer, detector, cfg.distributed.roll_call_seconds)
