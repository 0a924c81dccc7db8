"""Fault drill: break a small torchrun job in every way `[faults]` knows and check that it recovers.

    python scripts/fault_drill.py                      # every scenario, 3 random SIGKILL trials
    python scripts/fault_drill.py --trials 5 --seed 7 --nproc 2 --workdir /tmp/drill
    python scripts/fault_drill.py --only sigkill disk-full hsdp
    python scripts/fault_drill.py --in-process --trials 1   # replaced in-process (dtgpt.run) beside restart-all

Each scenario runs a tiny GPT (mock data, dropout on) for ITERS iterations on `--nproc` CPU
ranks under a plain `torchrun --max-restarts=1`, checkpointing every SAVE_INTERVAL iterations
with `checkpoint.load == checkpoint.save` (automatic resume), and compares the per-iteration
losses with an uninterrupted run of the same config on the same mesh: they must be bitwise
equal. The last-words scenarios run 4 ranks with every default timeout (torchrun's grace too): HSDP (dp_replicate 2 x dp_shard 2), a SIGKILL of a
random rank at a random iteration in forward/backward, in the optimizer step and in an async
save; and dp_shard 4 without replicas. The table: scenario, outcome, recovered, iterations
recomputed after the restart (trained twice), periodic checkpoints lost, losses equal after
resume; exit 1 when a scenario did not recover. This file runs them and prints the table; the
scenarios are in `scripts/drill_scenarios.py`, the plumbing in `scripts/drill_runs.py`;
tests/faults/ runs a deterministic subset of these scenarios in CI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # drill_scenarios, also when loaded by path
from drill_runs import HEADER, ITERS, OPT_OUT, SAVE_INTERVAL, Result, our_traceback_frames, plain_env  # noqa: E402
from drill_scenarios import (  # noqa: E402
    HANG_LIMITS, HSDP, NO_REPLICAS, Drill, in_process_scenarios, last_words_scenarios, scenarios,
)

__all__ = ["Drill", "HANG_LIMITS", "HSDP", "ITERS", "OPT_OUT", "our_traceback_frames", "plain_env", "scenarios"]

IN_PROCESS_HEADER = [
    "| scenario | outcome | recovered | survivors' PIDs unchanged | iterations recomputed | losses equal | "
    "recovery s, in-process | recovery s, restart-all + checkpoint (its outcome, iterations recomputed) |",
    "|---|---|---|---|---:|---|---:|---|",
]


def compared_row(replaced: Result, restarted: Result | None) -> str:
    def cell(v):
        return "n/a" if v is None else ("yes" if v is True else "NO" if v is False else str(v))

    def secs(v):
        return "n/a" if v is None else f"{v:.1f}"

    cells = [replaced.scenario, replaced.outcome, cell(replaced.ok), cell(replaced.pids_kept), cell(replaced.lost),
             cell(replaced.equal), secs(replaced.recovery),
             "n/a (no restart-all run)" if restarted is None else
             f"{secs(restarted.recovery)} ({restarted.outcome}; {cell(restarted.lost)} recomputed"
             f"{'' if restarted.ok else '; NOT recovered'})"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/dtgpt_fault_drill")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3, help="random SIGKILL trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="run scenarios whose name starts with one of these")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="with --in-process: cuda runs the scenarios on 4 GPUs over NCCL")
    parser.add_argument("--in-process", action="store_true",
                        help="only the in-process scenarios (python -m dtgpt.run), each beside a restart-all run")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    if workdir.exists():
        import shutil

        shutil.rmtree(workdir)
    if args.in_process:
        return run_in_process(workdir, args)
    drill = Drill(workdir, args.nproc)
    # The 4-rank layouts run with every default: collective timeout, roll call, torchrun's grace.
    hsdp = Drill(workdir / "hsdp", 4, layout=HSDP, grace=None, label="hsdp-")
    no_replicas = Drill(workdir / "no-replicas", 4, layout=NO_REPLICAS, grace=None, label="no-replicas-")
    print(f"fault drill: {args.nproc} ranks, {ITERS} iterations, checkpoint every {SAVE_INTERVAL}, work in {workdir}",
          flush=True)  # fmt: skip
    rows = []
    for name, scenario in scenarios(drill, args.trials, args.seed) + last_words_scenarios(hsdp, no_replicas, args.seed):
        if args.only and not any(name.startswith(p) for p in args.only):
            continue
        result = scenario()
        rows.append(result)
        print(result.row(), flush=True)
    print("\n".join(HEADER + [r.row() for r in rows]))
    failed = [r.scenario for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} scenarios recovered" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def run_in_process(workdir: Path, args) -> int:
    print(f"fault drill, in-process: 4 ranks, {ITERS} iterations, {args.trials} random kill(s) per layout, work in {workdir}",
          flush=True)  # fmt: skip
    rows, failed = [], []
    for name, scenario in in_process_scenarios(workdir, args.trials, args.seed, args.device):
        if args.only and not any(name.startswith(p) for p in args.only):
            continue
        replaced, restarted = scenario()
        rows.append(compared_row(replaced, restarted))
        print(rows[-1], flush=True)
        if not replaced.ok:
            failed.append(replaced.scenario)
    print("\n".join(IN_PROCESS_HEADER + rows))
    print(f"{len(rows) - len(failed)}/{len(rows)} recovered in-process" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
