"""In-process recovery: when a rank dies under `python -m dtgpt.run`, only it is replaced; the
survivors keep their state in memory and nobody reads or writes a checkpoint.

The launcher respawns the dead worker alone, with the same rank and `DTGPT_REPLACEMENT` set. Meanwhile:

1. **Detect, roll call** (detect.py, last_words.py): the survivors leave their collectives and
   report their last completed iteration and whether they were inside the optimizer step. The
   roll closes once every rank has answered or is known gone (the launcher's `replacing` keys).
2. **Decide** (`verdict`, a pure function): recover when launched by dtgpt.run, the ranks missing
   from the roll are exactly those the launcher replaces (a rank is known to be gone, never
   guessed from a failed collective), the consistency rule holds (last_words.consistent), every
   dead rank's replica twin (same pp/dp_shard/cp/tp coordinates, another dp_replicate index)
   survived, and the iteration was not redone already (one recovery per iteration; the
   launcher's `--max-restarts` bounds them per run); otherwise one line says why, and last
   words (or the last checkpoint) take over as under plain torchrun.
   **A bug is no death**: whatever a rank raises (a failed collective or an error of its own)
   goes to the roll call; when every rank answers, nobody died and the first rank to fail raised
   something of its own (its summary is in the failure notice): the job stops. The `stop` key
   tells the launcher not to restart, last words speak, and one line gives the error
   (`stopping: rank 1 raised RuntimeError: ...`).
3. **Rejoin**: each survivor destroys the old process groups and builds the default group and
   the mesh again (same shape), under a new store prefix (attempt_store.py's handshake, run
   again: the replacement runs it from start-up, as rank 0 or a follower).
4. **Hand over** (handover.py): survivors rebuild model and optimizer on the new mesh (FSDP,
   DTensor and pipeline stages hold the old groups) and copy their own shards in; the
   replacement, having built the same objects as at start-up, receives its shards, the optimizer
   state, progress, LR schedule, loss scale, the RNG states and the metrics logger's last record
   and open interval from its twin over their dp_replicate group.
5. **Redo** the interrupted iteration from its start: gradients are gone with the old objects,
   every rank rebuilds its data iterators at the consumed-samples count, and the RNG states are
   those at the iteration's start (snapshotted at each start: dp_replicate twins hold equal
   ones, as Megatron seeds dropout by pipeline stage only). The run stays bitwise identical to an
   uninterrupted one, and the metrics file records each iteration once (the interrupted one was
   never recorded).

The survivors and the replacement must issue the same collectives in the same order: mesh,
model, train state, handover, checkpointer, datasets: both build through training.Builder
(docs/faults.md, "In-process recovery").
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from dtgpt.faults.detect import FailureDetector, peer_gone, summary
from dtgpt.faults.last_words import InFlight, IterationWatch, Report, consistent, peer_failure, roll_call, speak
from dtgpt.parallel.dims import MESH_DIMS
from dtgpt.run.keys import (
    LAUNCHER_NAME,
    STOP_KEY,
    no_replacement_key,
    recovered_key,
    replacing_key,
    started_key,
)
from dtgpt.state import TrainState, rng_state


REDONE: tuple[str, ...] = ()
"""Phases between iterations that a recovery would redo in place. None yet: a replacement joins
at the top of the loop, so the survivors and it would issue different collectives (the
survivors the phase and the rest of the iteration's tail, the replacement the next iteration);
a death in the evaluation, the timers' reduction or a save falls back to last words."""


def twin_groups(dims) -> list[list[int]]:
    """The global ranks of each replica-twin group: equal pp/dp_shard/cp/tp coordinates, one per dp_replicate index."""
    ranks = dims.mesh.mesh.movedim(MESH_DIMS.index("dp_replicate"), -1)
    return ranks.reshape(-1, dims.dp_replicate).tolist()


def precondition(launched: bool, dp_replicate: int, roll_call_seconds: float) -> str | None:
    """Why no in-process recovery can happen in this run at all (checked without a roll call), or None."""
    if not launched:
        return "not launched by `python -m dtgpt.run`, which alone replaces one worker"
    if dp_replicate < 2:
        return "no replicas: parallel.data_parallel_replicate_size=1, so a dead rank's shards exist nowhere else"
    if roll_call_seconds <= 0:
        return "distributed.roll_call_seconds=0 turns the survivors' roll call off"
    return None


def verdict(
    launched: bool, dp_replicate: int, reports: dict[int, Report] | None, twins: list[list[int]],
    refused: dict[int, str] | None = None, roll_call_seconds: float = 10.0, replaced: set[int] | None = None,
    redone: set[str] = frozenset(), redo: str = "",
) -> str | None:
    """Why the survivors cannot recover in-process, or None when they can. `reports`: the
    survivors' roll call (None when this rank missed it); `refused`: the launcher's reason per
    dead rank it will not replace; `replaced`: the ranks the launcher says died and replaces
    (None: every missing rank, for callers that do not ask); `redo`: what would be redone
    ("iteration 15"), `redone`: what was redone already in this run."""
    why = precondition(launched, dp_replicate, roll_call_seconds)
    if why is not None:
        return why
    if reports is None:
        return "this rank answered the roll call too late"
    if refused:
        rank = min(refused)
        return f"the launcher will not replace rank {rank} ({refused[rank]})"
    missing = {rank for group in twins for rank in group} - set(reports)
    if not missing:
        return "every rank answered the roll call, so no rank died"
    unknown = sorted(missing - (missing if replaced is None else replaced))
    if unknown:
        return f"rank(s) {unknown} did not answer the roll call, yet the launcher did not say they died (stuck?)"
    iteration, why = consistent(reports)
    if iteration is None:
        return why
    for group in twins:
        if not any(rank in reports for rank in group):
            return f"rank(s) {group} hold the same shards and all died"
    if redo and redo in redone:
        return f"{redo} was redone once already"
    return None


class Echo(SystemExit):
    """A rank leaves after a failure that it did not cause and that is said already in one line
    (`Recovery._an_echo`): exit 1, so the launcher restarts the job (or stops it, after a bug),
    without a traceback of the failed collective."""


@dataclass
class Pending:
    """A recovery decided in the train step, carried out by the loop (`recover`)."""

    rng: dict[str, torch.Tensor]
    """The RNG states at the start of the iteration to redo."""
    dead: list[int]
    redo: str
    """What is redone: "iteration 15", "the evaluation after iteration 14"."""


class Recovery(IterationWatch):
    """Wraps each train step (as last_words.LastWords does); on a peer's failure: roll call,
    decide, and either mark the step for an in-process recovery (the exception is swallowed;
    `pending` is set) or say why not, let last words speak, and leave: with the error when it
    is this rank's own (a bug perhaps: its traceback), else with exit 1 and no traceback (`Echo`).
    An error of this rank's own stops the job (the module doc, "a bug is no death")."""

    def __init__(
        self, state: TrainState, runtime, detector: FailureDetector, seconds: float, checkpointer, last_words,
        redone: set[str] = frozenset(),
    ):  # fmt: skip
        """`last_words`: the fallback's LastWords (it speaks), or None (Silent: nothing to save);
        `redone`: what this run redid already (one recovery each at most)."""
        self.state, self.runtime, self.detector, self.seconds = state, runtime, detector, seconds
        self.checkpointer, self.last_words = checkpointer, last_words
        self.inflight = last_words.inflight if last_words is not None else InFlight(state)
        self.pending: Pending | None = None
        self.redone = set(redone)
        self.shared = detector.store.underlying_store
        self.died = False
        """A roll call of this watch missed a rank: it died (or is stuck)."""

    def _launcher_keys(self, key) -> dict[int, str]:
        keys = {r: key(r) for r in range(self.runtime.world_size)}
        return {r: self.shared.get(k).decode() for r, k in keys.items() if self.shared.check([k])}

    def _replaced(self) -> set[int]:
        """The ranks the launcher is replacing now: a `replacing` number no replacement has yet
        reported `recovered` (the keys of an earlier recovery stay in the store)."""
        recovered = self._launcher_keys(recovered_key)
        return {r for r, n in self._launcher_keys(replacing_key).items() if int(n) > int(recovered.get(r, 0))}

    def _known_dead(self) -> int:
        """Ranks the launcher replaces or gave up on: the roll call need not wait for them."""
        return len(self._replaced() | self._launcher_keys(no_replacement_key).keys())

    @contextlib.contextmanager
    def guard(self, phase: str = "") -> Iterator[None]:
        """`phase`: "" for the train step or the checks between iterations (a recovery redoes the
        next iteration), `REDONE` phases are redone themselves, any other phase is not (a
        checkpoint save: a death there is left to last words and a restart)."""
        try:
            yield
        except Exception as e:  # a failed collective or this rank's own error: the roll call tells which
            self.detector.declare(summary(e))
            if not self._decide(phase):
                if not peer_failure(e):  # an error of dtgpt's own (bad input, say): its one line, or its traceback
                    raise
                if self._an_echo():
                    raise Echo(1) from None
                if peer_gone(e):  # the first to fail, on a dead peer nobody has named yet: one line
                    print(f"failure: rank {self.runtime.rank} lost a peer ({summary(e)}); it exits for a restart", flush=True)
                    raise Echo(1) from None
                raise  # this rank's own error, a bug perhaps, or a timeout: its traceback says where

    def _an_echo(self) -> bool:
        """Whether this rank's error only echoes a failure that is said already: a rank died (the
        roll call or the launcher says so; the fallback's line and last words tell the rest), or
        another rank failed first (its error is the one that counts, shown by that rank). The rank
        whose own error came first, a bug perhaps, keeps its traceback."""
        notice = self.detector.notice()
        another = notice is not None and notice["rank"] != self.runtime.rank
        if self.shared.check([STOP_KEY]):  # a bug, and nobody died: only the rank that raised it shows it
            return another
        return another or self.died or bool(self._replaced() or self._launcher_keys(no_replacement_key))

    def _stop(self, why: str) -> None:
        """Tell the launcher that this job stops (no replacement, no restart); the first reason stays."""
        self.shared.compare_set(STOP_KEY, "", why)

    def _decide(self, phase: str) -> bool:
        state, rank, dims, store = self.state, self.runtime.rank, self.state.model.dims, self.detector.store
        launched = self.runtime.launcher == LAUNCHER_NAME
        reports, why = None, precondition(launched, dims.dp_replicate, self.seconds)
        done = state.progress.iteration
        redo = f"the {phase} after iteration {done}" if phase else f"iteration {done + 1}"
        if launched and self.seconds > 0:  # without replicas too: the roll call tells a bug from a death
            report = Report(state.progress.iteration, self.inflight.stepping)
            reports = roll_call(store, rank, dims.world_size, report, self.seconds, self._known_dead)
            self.died = reports is not None and len(reports) < dims.world_size
        if why is None:
            why = verdict(
                True, dims.dp_replicate, reports, twin_groups(dims), self._launcher_keys(no_replacement_key),
                self.seconds, self._replaced(), self.redone, redo,
            )  # fmt: skip
            if why is None and phase and phase not in REDONE:
                why = f"a rank failed during the {phase}, which is not redone"
        if reports is not None and len(reports) == dims.world_size:  # nobody died: the first failure was a bug
            notice = self.detector.notice() or {"rank": rank, "why": "an error"}
            self._stop(f"rank {notice['rank']} raised {notice['why']}")
        if why is None:
            rng = self.inflight.rng or rng_state(state.model)  # None: the failure came after the iteration
            dead = sorted(set(range(dims.world_size)) - set(reports))
            self.pending = Pending(rng, dead, redo)
            self.redone.add(redo)
            return True
        stop = self.shared.get(STOP_KEY).decode() if self.shared.check([STOP_KEY]) else None
        # One line: the roll's first rank, or without a roll the first to get here.
        speaker = rank == min(reports) if reports else store.compare_set("recovery/speaker", "", str(rank)) == str(rank).encode()
        if speaker and stop is None:
            fallback = "last words follow" if self.last_words else "the restart resumes from the last checkpoint"
            print(f"in-process recovery: none ({why}); {fallback}", flush=True)
        if self.last_words is not None and not (stop and dims.dp_replicate < 2):  # (no replicas: no save, no restart to name)
            spoken = speak(state, self.checkpointer, store, self.inflight, self.seconds, self._known_dead)
            self.died = self.died or (spoken is not None and len(spoken) < dims.world_size)
        if speaker and stop is not None:
            print(f"stopping: {stop}; no rank died of it: no recovery, no restart", flush=True)
        return False

    def close(self) -> None:
        self.detector.close()


def rejoin_process_group(cfg, runtime) -> None:
    """Destroy the old groups (left by detect.py) and build the default group and the mesh again,
    same shape, under a new store prefix; `runtime` is updated in place."""
    from dtgpt.distributed import init_process_group
    from dtgpt.parallel.dims import ParallelDims

    shared = runtime.store.underlying_store
    start = time.perf_counter()
    dist.destroy_process_group()
    runtime.dims.release_groups()  # the old mesh's groups: their threads end with them
    runtime.store = init_process_group(cfg, runtime.device, shared)
    dims = ParallelDims.from_config(cfg, runtime.world_size)
    dims.build_mesh(runtime.device.type)
    runtime.dims = dims
    if runtime.is_main:  # (a replaced rank 0 says nothing here: it is the replacement)
        print(f"in-process recovery: the process group is rebuilt in {time.perf_counter() - start:.2f} s", flush=True)


def mark_started(runtime) -> None:
    """Tell `python -m dtgpt.run` that this rank reached its first iteration: a failure before
    it is a start-up error, which the launcher neither restarts nor replaces (dtgpt/run/keys.py)."""
    if runtime.launcher == LAUNCHER_NAME and runtime.store is not None:
        runtime.store.underlying_store.set(started_key(runtime.rank), "1")


def build_failure_watch(cfg, runtime, state: TrainState, checkpointer, after=None):
    """What wraps each train step: in-process recovery (with last words as its fallback) when
    the run may recover so, else last words (or the Silent detector) alone. `after`: the watch
    of a recovery just made (its iterations redone carry over)."""
    from dtgpt.faults.last_words import LastWords, build_last_words

    mark_started(runtime)
    watch = build_last_words(cfg, runtime, state, checkpointer)
    if watch.detector is None:  # one process
        return watch
    last_words = watch if isinstance(watch, LastWords) else None
    redone = getattr(after, "redone", set())
    return Recovery(state, runtime, watch.detector, cfg.distributed.roll_call_seconds, checkpointer, last_words, redone)


def exchange(state: TrainState, runtime, own: dict | None) -> dict:
    """Every rank of the new world: who is new, then the handover (handover.py)."""
    from dtgpt.faults.handover import hand_over

    flags: list = [None] * runtime.world_size
    dist.all_gather_object(flags, own is None)
    newcomers = {rank for rank, new in enumerate(flags) if new}
    twins = next(group for group in twin_groups(runtime.dims) if runtime.rank in group)
    received = hand_over(state, twins, newcomers, own)
    received["source"] = min(r for r in twins if r not in newcomers)
    received["newcomers"] = sorted(newcomers)
    return received


def join(state: TrainState, runtime) -> dict:
    """A replacement, right after building its train state as at start-up: take the twin's."""
    from dtgpt.faults.handover import load_scalars

    received = exchange(state, runtime, None)
    load_scalars(state, received["scalars"])
    runtime.store.underlying_store.set(recovered_key(runtime.rank), str(runtime.replacement))
    print(f"in-process recovery: rank {runtime.rank} (replacement {runtime.replacement}) took its state from rank "
          f"{received['source']} at iteration {state.progress.iteration}", flush=True)  # fmt: skip
    return received


def recover(pending: Pending, state: TrainState, builder, checkpointer, metrics) -> tuple:
    """A survivor, after `Recovery` decided: rejoin, rebuild, hand over (with `metrics`, the
    logger's `kept`); returns the train and validation iterators at the start of the iteration
    to redo (RNG states set to its start)."""
    from dtgpt.faults.handover import keep
    from dtgpt.state import set_rng_state

    start = time.perf_counter()
    runtime = builder.runtime
    if checkpointer is not None:
        checkpointer.wait()  # a background save in flight ends first (it fails, or it completes)
    own = keep(state, pending.rng, metrics)
    state.model = state.optimizer = None  # the old objects go (their groups are left): memory for the new ones
    gc.collect()
    if runtime.device.type == "cuda":
        torch.cuda.empty_cache()
    rejoin_process_group(builder.cfg, runtime)
    fresh = builder.build_state()
    received = exchange(fresh, runtime, own)
    state.model, state.optimizer = fresh.model, fresh.optimizer
    if checkpointer is not None:
        checkpointer.rejoin()
    _datasets, train_iter, valid_iter, _test = builder.data(state)
    set_rng_state(received["rng"], state.model)
    if runtime.rank == min(set(range(runtime.world_size)) - set(pending.dead)):
        print(f"in-process recovery: rank(s) {pending.dead} replaced, the others kept their state; {pending.redo} "
              f"is redone ({time.perf_counter() - start:.2f} s)", flush=True)  # fmt: skip
    return train_iter, valid_iter
