#!/usr/bin/env python
"""The first thing to run on a GPU, in one command of at most 9 minutes: the one-GPU benchmark
against plain PyTorch at 124m, 350m and 1.3b, eager then compiled, with its profile; the tests
only a GPU runs (marked `cuda`); a bf16 training run on CUDA with a save, an async save and a
resume. One table of what passed and the figures, for docs/performance.md ("GPU check").

    bash scripts/gpu_check.sh                                   # or: make gpu-check
    bash scripts/gpu_check.sh --budget-s 300 --only bench-eager,suite
    bash scripts/gpu_check.sh --megatron-core megatron_core-0.16.1-py3-none-any.whl

On a lent device machine, as one command with a 590 s limit whose $OUT folder comes back
(python3 there holds torch 2.11, pytest, numpy and tensorboard; docs/performance.md, "GPU check"):

    PYTHON=python3 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh --out $OUT

The budget (--budget-s, default 540) is split into per-step shares (STEPS, scaled to the budget);
a step may use its own share and whatever earlier steps left, never the later steps' shares, and
is cut (its process group killed) at that limit; a step left with under MIN_STEP_S is reported as
not run. --out is flat and holds at most 8 files (summary.md, each step's log, each benchmark's
JSON); summary.md is rewritten as each step finishes, so a run stopped from outside still brings
back what finished. Checkpoints and metrics go to a scratch folder (--work). Without CUDA it stops
at once with one error line.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also when loaded by path
from gpu_check_figures import bench_figures, bench_table, suite_figures, train_figures  # noqa: E402


@dataclass
class Step:
    name: str
    share_s: int
    what: str


# Shares of the default 540 s (docs/performance.md, "GPU check", says how they were sized).
STEPS = (
    Step("bench-eager", 110, "scripts/bench.py --sizes 124m,350m,1.3b --no-compile --profile, 2 ABBA rounds of 3 warm-up + 10 timed"),
    Step("bench-compiled", 260, "scripts/bench.py --sizes 124m,350m,1.3b --compile --profile, 1 round of 5 warm-up + 15 timed"),
    Step("suite", 70, "pytest -m cuda (DTGPT_SLOW=1): the tests only a GPU runs"),
    Step("train", 50, "train.py bf16 on CUDA: iterations 1-10 with a save at 5 and at 10"),
    Step("resume", 50, "train.py resumes at 11, async saves at 15 and 20"),
)
DEFAULT_BUDGET_S = sum(s.share_s for s in STEPS)
MIN_STEP_S = 10.0
SIZES = "124m,350m,1.3b"
BENCH = {  # bench.py's settings per step: (compile flag, warm-up, timed iterations, rounds)
    "bench-eager": ("--no-compile", 3, 10, 2),
    "bench-compiled": ("--compile", 5, 15, 1),  # one round: a compile per side and size is most of its time
}
TRAIN = ["--config", "configs/debug.toml", "--training.device=cuda", "--training.bf16=true",
         "--training.train_iters=20", "--checkpoint.save_interval=5", "--eval.eval_interval=10"]  # fmt: skip


@dataclass
class Task:
    """One step as it will run: its command, what it reads back, and what it needs first."""

    step: Step
    cmd: list[str]
    figures: Callable[[Path], str] = lambda log: ""
    verify: Callable[[str], str | None] = lambda figures: None  # a reason to fail a step that exited 0
    needs: str | None = None
    env: dict | None = None


@dataclass
class Result:
    name: str
    status: str  # passed, FAILED, cut, not run
    seconds: float = 0.0
    figures: str = ""
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class Environment:
    date: str
    gpu: str
    torch: str
    megatron: str = "not installed"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    names = [s.name for s in STEPS]
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help=f"seconds for all steps (default {DEFAULT_BUDGET_S})")
    p.add_argument("--only", default=",".join(names), help="comma-separated steps, run in the order above (default: all): " + ", ".join(names))
    p.add_argument("--out", default="runs/gpu_check", help="summary.md, the logs and the benchmark JSON (flat, at most 8 files)")
    p.add_argument("--work", default=None, help="checkpoints and metrics (default: a new folder under the system's temp)")
    p.add_argument("--megatron-core", metavar="WHEEL", help="install this megatron-core wheel first (the oracle tests need it)")
    args = p.parse_args(argv)
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in args.only if n not in names] or ([] if args.only else [""])
    if unknown:
        p.error(f"--only: unknown step {unknown[0]!r}; the steps are {', '.join(names)}")
    if "resume" in args.only and "train" not in args.only:
        p.error("--only: resume continues the train step's run; name train too")
    if args.budget_s < MIN_STEP_S:
        p.error(f"--budget-s: {args.budget_s:g} is under {MIN_STEP_S:g}, the least a step is given")
    if args.megatron_core and not Path(args.megatron_core).is_file():
        p.error(f"--megatron-core: {args.megatron_core}: no such file")
    return args


def cuda_problem() -> str | None:
    """Why this machine cannot run the check, or None."""
    import torch

    if not torch.cuda.is_available():
        return "gpu_check needs a CUDA device and torch.cuda.is_available() is False here (torch " + torch.__version__ + ")"
    return None


def run(cmd: list[str], limit_s: float, log: Path, env: dict | None = None) -> tuple[int | None, float]:
    """Run cmd with its output in `log`; (exit code, or None if cut at the limit; seconds). A cut
    kills the whole process group: compile workers and torchrun ranks hold the GPU otherwise."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):  # the group's stragglers too
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
    return code, time.perf_counter() - start


def result_of(task: Task, code: int | None, seconds: float, log: Path, limit_s: float) -> Result:
    figures = task.figures(log)
    if code is None:
        return Result(task.step.name, "cut", seconds, figures, f"cut at its {limit_s:.0f} s")
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        return Result(task.step.name, "FAILED", seconds, figures, f"exit {code}: {tail[0] if tail else ''}")
    problem = task.verify(figures)
    return Result(task.step.name, "FAILED" if problem else "passed", seconds, figures, problem or "")


def limits(tasks: list[Task], budget_s: float) -> list[float]:
    """Each step's share of the budget: its STEPS share scaled so the chosen steps' shares sum to it."""
    scale = budget_s / sum(t.step.share_s for t in tasks)
    return [scale * t.step.share_s for t in tasks]


def run_tasks(tasks: list[Task], budget_s: float, out: Path, header: str, clock=time.monotonic) -> list[Result]:
    """Run the tasks in order within the budget, rewriting out/summary.md after each."""
    shares = limits(tasks, budget_s)
    deadline = clock() + budget_s
    results: list[Result] = []
    for i, task in enumerate(tasks):
        limit = deadline - clock() - sum(shares[i + 1 :])  # its share and what earlier steps left
        needed = next((r for r in results if r.name == task.needs), None)
        if needed is not None and not needed.passed:
            results.append(Result(task.step.name, "not run", detail=f"{task.needs} did not pass"))
        elif limit < MIN_STEP_S:
            results.append(Result(task.step.name, "not run", detail=f"{max(limit, 0):.0f} s of the budget left for it"))
        else:
            log = out / f"{task.step.name}.log"
            code, seconds = run(task.cmd, limit, log, task.env)
            results.append(result_of(task, code, seconds, log, limit))
        r = results[-1]  # also on stdout, which comes back even where the files do not
        print(f"{r.name}: {r.status} in {r.seconds:.0f} s (limit {max(limit, 0):.0f} s) {'; '.join(x for x in (r.detail, r.figures) if x)}", flush=True)
        pending = [Result(t.step.name, "pending") for t in tasks[i + 1 :]]
        (out / "summary.md").write_text(summary_table(header, results + pending, out, budget_s, shares))
    return results


def summary_table(header: str, results: list[Result], out: Path, budget_s: float, shares: list[float]) -> str:
    """The markdown block docs/performance.md takes as it is: the steps, then the benchmark's table."""
    lines = [header, "", f"budget {budget_s:.0f} s: " + ", ".join(f"{r.name} {s:.0f}" for r, s in zip(results, shares)), "",
             "| step | result | seconds | figures |", "|---|---|---|---|"]  # fmt: skip
    for r in results:
        note = r.figures if r.passed else "; ".join(x for x in (r.detail, r.figures) if x)
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.0f} | {note.replace('|', '/')} |")
    done = [r for r in results if r.status != "pending"]
    lines += ["", f"{sum(r.passed for r in done)} of {len(results)} steps passed"]
    rows = [row for name in BENCH for row in bench_table(out / f"{name}.json", name.split("-")[1])]
    if rows:
        lines += ["", "| size | compile | dtgpt tokens/s | plain PyTorch tokens/s | ratio | MFU dtgpt / plain "
                  "| kernels/step dtgpt / plain | GPU busy dtgpt / plain | AdamW ms/step dtgpt / plain |",
                  "|---|---|---:|---:|---:|---|---|---|---|", *rows]  # fmt: skip
    return "\n".join(lines) + "\n"


def environment() -> Environment:
    import torch

    try:
        from importlib.metadata import version

        megatron = version("megatron-core")
    except Exception:
        megatron = "not installed"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return Environment(datetime.datetime.now().astimezone().isoformat(timespec="seconds"), gpu, torch.__version__, megatron)


def build_tasks(names: list[str], out: Path, work: Path) -> list[Task]:
    """The chosen steps as commands: benchmarks and logs in `out`, checkpoints and metrics in `work`."""
    py, save = sys.executable, work / "ckpt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tasks = []
    for step in (s for s in STEPS if s.name in names):
        if step.name in BENCH:
            flag, warmup, iters, rounds = BENCH[step.name]
            js = out / f"{step.name}.json"
            cmd = [py, "scripts/bench.py", "--device", "cuda", "--sizes", SIZES, flag, "--profile", "--warmup", str(warmup),
                   "--iters", str(iters), "--rounds", str(rounds), "--json", str(js)]  # fmt: skip
            tasks.append(Task(step, cmd, lambda log, js=js: bench_figures(js), env=env))
        elif step.name == "suite":
            cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"]
            suite_env = {**env, "DTGPT_SLOW": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            tasks.append(Task(step, cmd, suite_figures, env=suite_env))
        elif step.name == "train":
            metrics = work / "train.jsonl"
            cmd = [py, "train.py", *TRAIN, f"--checkpoint.save={save}", "--checkpoint.exit_interval=10", f"--logging.metrics_file={metrics}"]
            tasks.append(Task(step, cmd, lambda log, m=metrics: train_figures(m, 1), env=env))
        elif step.name == "resume":
            metrics = work / "resume.jsonl"
            cmd = [py, "train.py", *TRAIN, f"--checkpoint.save={save}", f"--checkpoint.load={save}", "--checkpoint.async_save=true",
                   f"--logging.metrics_file={metrics}"]  # fmt: skip

            def resumed(figures: str) -> str | None:
                return None if figures.startswith("iterations 11-20") else f"did not resume at 11: {figures or 'no metrics'}"

            tasks.append(Task(step, cmd, lambda log, m=metrics: train_figures(m, 11), resumed, needs="train", env=env))
    return tasks


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    problem = cuda_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    start = time.monotonic()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.megatron_core:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", args.megatron_core], check=True)
    env = environment()
    header = f"GPU check, {env.date}: {env.gpu}, torch {env.torch}, megatron-core {env.megatron}"
    print(header + f"\n(scratch: {work}; the table is rewritten to {out / 'summary.md'} after each step)", flush=True)
    results = run_tasks(build_tasks(args.only, out, work), args.budget_s - (time.monotonic() - start), out, header)
    print("\n" + (out / "summary.md").read_text() + "\n(paste it under docs/performance.md's \"GPU check\")", flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
