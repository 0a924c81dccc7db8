"""The SIGKILL scenarios of scripts/drill_scenarios.py: the `[faults]` flags of each kind of kill, its
name, what it leaves complete, and which kinds fall back to last words under dtgpt.run."""

from __future__ import annotations


def kill_faults(rank: int, iteration: int, during: str, async_save: bool) -> list[str]:
    phase = {"eval": ["--eval.eval_iters=1", "--eval.eval_interval=1"],
             "after-step-timed": ["--logging.timers_log_level=1"]}.get(during, [])  # fmt: skip
    return [f"--faults.kill_at_iteration={iteration}", f"--faults.kill_rank={rank}",
            f"--faults.kill_during_save={during == 'save'}", f"--faults.kill_during_step={during == 'step'}",
            f"--faults.kill_after_step={during.startswith('after-step')}", f"--faults.kill_during_eval={during == 'eval'}",
            f"--checkpoint.async_save={async_save}", *phase]  # fmt: skip


def kill_kind(during: str, async_save: bool) -> str:
    if during == "save":
        return "save-" + ("async" if async_save else "sync")
    return during  # iteration, step, after-step (the stop decision's collective), after-step-timed (the timers'), eval


def completed_at_kill(iteration: int, during: str) -> int:
    """The iterations complete when the rank dies: a kill in forward/backward comes before its
    iteration is done; one in the optimizer step, after it, in the evaluation or the save after
    it, once the others finish it."""
    return iteration - 1 if during == "iteration" else iteration


FALLS_BACK = {"after-step-timed": "timers' reduction", "eval": "evaluation", "save": "checkpoint save"}
"""Kills outside the step whose phase is not redone: under dtgpt.run the survivors fall back to
last words (one line says why) and a full restart, which resumes from what they saved."""
