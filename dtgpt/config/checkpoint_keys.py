"""[checkpoint]'s keys for what a save keeps, where a load may start from, and which signal stops a
run cleanly (Megatron's --no-save-rng, --exit-on-missing-checkpoint, --pretrained-checkpoint, --exit-signal).

Kept apart from dtgpt/config/sections.py, which holds the save and load basics.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
"""The signals Megatron's --exit-signal may name."""


@dataclass
class CheckpointKeys:
    save_rng: bool = True
    """False (Megatron's --no-save-rng): checkpoints hold no generator states; a resume from one keeps
    the fresh seeding, as checkpoint.load_rng=false does."""
    exit_on_missing_checkpoint: bool = False
    """With checkpoint.load set, finding no checkpoint there is an error instead of a start from
    scratch (Megatron's --exit-on-missing-checkpoint: a typo in the path stops the run)."""
    pretrained_checkpoint: str = ""
    """Megatron's --pretrained-checkpoint: where the load directory holds no checkpoint yet, the run
    fine-tunes from this one (its weights only, as checkpoint.finetune); once the load directory
    holds one, the run resumes from it."""
    exit_signal: str = ""
    """The one signal the exit-signal handler catches (Megatron's --exit-signal: one of EXIT_SIGNALS);
    empty: SIGTERM and SIGINT (docs/faults.md)."""
