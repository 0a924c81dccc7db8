"""The sections that run around training rather than define it: [distributed] (collectives,
heartbeats, last words), [profiling] and [faults] (deliberate faults for drills and tests).

Kept apart from dtgpt/config/sections.py, which holds the other sections and the Config of all.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DistributedConfig:
    backend: str = "auto"
    """'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'."""
    timeout_minutes: float = 10.0
    """Collective timeout: a stuck (live) peer becomes an error after this long, not a hang. A dead
    peer needs no timeout: the failure notice makes every rank leave its collectives
    (dtgpt/faults/detect.py)."""
    heartbeat_factor: float = 10.0
    """Print a heartbeat when a phase runs this many times the median iteration (0 disables)."""
    heartbeat_min_seconds: float = 30.0
    """...and at least this long; the heartbeat then repeats at this interval."""
    roll_call_seconds: float = 10.0
    """After a collective fails in the train step (a peer died), how long the survivors wait for
    each other before deciding on last words (dtgpt/faults/last_words.py; needs checkpoint.save; 0: no
    last words). torchrun's --shutdown-timeout must exceed it plus one checkpoint save."""


@dataclass
class ProfilingConfig:
    profile_step_start: int = 0
    """First iteration traced by torch.profiler; 0 disables profiling."""
    profile_step_end: int = 0
    """The trace is written when this iteration starts (exclusive)."""
    trace_dir: str = ""
    """Each rank writes rank{N}.*.pt.trace.json here (TensorBoard's profiler plugin reads it)."""
    memory_snapshot_path: str = ""
    """CUDA only: an allocator-history pickle over the window ('{rank}' is filled in)."""
    profile_ranks: list[int] = field(default_factory=list)
    """The ranks that profile (and record memory history); empty: every rank (Megatron's --profile-ranks)."""
    record_memory_history: bool = False
    """CUDA only: record the allocator's history from the start of training and dump it to
    memory_snapshot_path (default snapshot.pickle) at every log interval (Megatron's --record-memory-history)."""


@dataclass
class FaultsConfig:
    """Deliberate faults for drills and tests; empty in real runs."""

    nan_at_iterations: list[int] = field(default_factory=list)
    """Make the loss and one gradient non-finite at these iterations (tests the NaN guard)."""
    kill_at_iteration: int = 0
    """SIGKILL rank kill_rank during this iteration (0: never). Like every fault below, only on
    the first attempt: a group restarted by torchrun (TORCHELASTIC_RESTART_COUNT > 0) runs clean."""
    kill_rank: int = 0
    kill_also_ranks: list[int] = field(default_factory=list)
    """More ranks SIGKILLed with kill_rank, at the same point (several at once: a whole replica)."""
    kill_during_save: bool = False
    """Kill in the checkpoint save of kill_at_iteration instead, after this rank wrote its data."""
    kill_during_step: bool = False
    """Kill inside the optimizer step of kill_at_iteration instead (the first model part's
    parameters updated, the iteration not yet recorded)."""
    kill_after_step: bool = False
    """Kill after the train step of kill_at_iteration instead (the iteration complete, not yet
    recorded): the survivors fail in a collective between iterations (the timers' reduction)."""
    kill_during_eval: bool = False
    """Kill in the first evaluation forward after kill_at_iteration instead."""
    kill_again_at_iteration: int = 0
    """SIGKILL rank kill_again_rank in this iteration too (0: never): a second death, after a
    recovery from the first (a replacement runs clean, as a restarted group does)."""
    kill_again_rank: int = 0
    raise_at_iteration: int = 0
    """Rank raise_rank's model forward raises RuntimeError from this iteration on (0: never): a
    bug, not a death, which no restart or recovery cures."""
    raise_rank: int = 0
    hang_at_iteration: int = 0
    """Rank hang_rank sleeps forever in this iteration (0: never): a stuck peer."""
    hang_rank: int = 0
    signal_at_iteration: int = 0
    """Rank signal_rank sends itself signal_name in this iteration, and SIGTERM and SIGINT again
    while the checkpoint that follows is written (0: never)."""
    signal_rank: int = 0
    signal_name: str = "SIGTERM"
    disk_full_at_iteration: int = 0
    """The checkpoint save of this iteration fails with ENOSPC on rank disk_full_rank, after
    writing part of its data (0: never)."""
    disk_full_rank: int = 0
