#!/usr/bin/env python
"""The first thing to run on a GPU: the suite with CUDA visible, the one-GPU benchmark, and a bf16
training run on CUDA with a save, an async save and a resume; then one table of what passed and
the figures, for docs/performance.md ("GPU check").

    bash scripts/gpu_check.sh                                   # or: make gpu-check
    bash scripts/gpu_check.sh --megatron-core megatron_core-0.16.1-py3-none-any.whl
    bash scripts/gpu_check.sh --only train,bench --out runs/gpu_check

Bounded to about 8 minutes on one H100: each step has its own time limit (STEPS) and a step that
runs past it is reported as such, not waited for. Without CUDA it stops at once with one error line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    name: str
    limit_s: int
    what: str


STEPS = (
    Step("suite", 270, "pytest, the edit-loop set, CUDA visible (tests marked cuda run; the rest pin CPU)"),
    Step("bench", 150, "scripts/bench.py --sizes 124m,1.3b: dtgpt against plain PyTorch"),
    Step("train", 60, "train.py bf16 on CUDA: iterations 1-10 with a save at 5 and at 10"),
    Step("resume", 60, "train.py resumes at 11, async saves at 15 and 20"),
)
"""The steps in order and each one's limit; the limits sum to about 9 minutes at most."""

TRAIN = ["--config", "configs/debug.toml", "--training.device=cuda", "--training.bf16=true",
         "--training.train_iters=20", "--checkpoint.save_interval=5", "--eval.eval_interval=10"]  # fmt: skip


@dataclass
class Result:
    name: str
    passed: bool
    seconds: float
    figures: str = ""
    detail: str = ""
    timed_out: bool = False


@dataclass
class Environment:
    date: str
    gpu: str
    torch: str
    megatron: str = "not installed"
    extra: dict = field(default_factory=dict)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-core", metavar="WHEEL", help="install this megatron-core wheel first (the oracle tests need it)")
    p.add_argument("--only", default=",".join(s.name for s in STEPS), help="comma-separated steps (default: all): "
                   + ", ".join(s.name for s in STEPS))  # fmt: skip
    p.add_argument("--out", default="runs/gpu_check", help="where the runs, the logs and summary.md go")
    args = p.parse_args(argv)
    names = {s.name for s in STEPS}
    unknown = [n for n in args.only.split(",") if n not in names]
    if unknown:
        p.error(f"--only: unknown step {unknown[0]!r}; the steps are {', '.join(s.name for s in STEPS)}")
    if "resume" in args.only.split(",") and "train" not in args.only.split(","):
        p.error("--only: resume continues the train step's run; name train too")
    if args.megatron_core and not Path(args.megatron_core).is_file():
        p.error(f"--megatron-core: {args.megatron_core}: no such file")
    return args


def cuda_problem() -> str | None:
    """Why this machine cannot run the check, or None."""
    import torch

    if not torch.cuda.is_available():
        return "gpu_check needs a CUDA device and torch.cuda.is_available() is False here (torch " + torch.__version__ + ")"
    return None


def run(cmd: list[str], limit_s: int, log: Path, env: dict | None = None) -> tuple[int | None, float]:
    """Run cmd with its output in `log`; (exit code or None past the limit, seconds)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=limit_s, env=env).returncode
        except subprocess.TimeoutExpired:
            code = None
    return code, time.perf_counter() - start


def result_of(step: Step, code: int | None, seconds: float, log: Path, figures: str = "") -> Result:
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    detail = f"ran past its {step.limit_s} s" if code is None else ("" if code == 0 else f"exit {code}: {tail[0] if tail else ''}")
    return Result(step.name, code == 0, seconds, figures, detail, timed_out=code is None)


def suite_figures(log: Path) -> str:
    """pytest's last line: `12 passed, 3 skipped in 80.1s`."""
    lines = [ln.strip("= ") for ln in log.read_text(errors="replace").splitlines() if " in " in ln and ("passed" in ln or "failed" in ln)]
    return lines[-1] if lines else ""


def bench_figures(path: Path) -> str:
    """tokens/s ratio and MFU per size from bench.py's --json."""
    if not path.exists():
        return ""
    results = json.loads(path.read_text()).get("results", {})
    parts = []
    for size, res in results.items():
        ratio, mfu = res.get("ratio"), res.get("dtgpt", {}).get("mfu")
        parts.append(f"{size}: ratio {ratio:.3f}" if ratio is not None else f"{size}: failed")
        if mfu is not None:
            parts[-1] += f", MFU {mfu:.1%}"
    return "; ".join(parts)


def train_figures(metrics: Path, first: int) -> str:
    """The first and last loss and the median tokens/s of a run's metrics from iteration `first`."""
    if not metrics.exists():
        return ""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("iteration", 0) >= first and "loss" in r]
    if not rows:
        return ""
    speeds = sorted(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
    speed = f", {speeds[len(speeds) // 2]:,.0f} tokens/s" if speeds else ""
    return f"iterations {rows[0]['iteration']}-{rows[-1]['iteration']}, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}{speed}"


def summary_table(env: Environment, results: list[Result]) -> str:
    """The markdown block docs/performance.md takes as it is."""
    lines = [
        f"GPU check, {env.date}: {env.gpu}, torch {env.torch}, megatron-core {env.megatron}",
        "",
        "| step | result | seconds | figures |",
        "|---|---|---|---|",
    ]
    for r in results:
        verdict = "passed" if r.passed else ("timed out" if r.timed_out else "FAILED")
        note = r.figures if r.passed else "; ".join(x for x in (r.detail, r.figures) if x)
        lines.append(f"| {r.name} | {verdict} | {r.seconds:.0f} | {note.replace('|', '/')} |")
    passed = sum(r.passed for r in results)
    lines += ["", f"{passed} of {len(results)} steps passed"]
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


def run_steps(args: argparse.Namespace, out: Path) -> list[Result]:
    chosen = [s for s in STEPS if s.name in args.only.split(",")]
    py, results = sys.executable, []
    save = out / "ckpt"
    for step in chosen:
        log = out / f"{step.name}.log"
        if step.name == "suite":
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            code, seconds = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider"], step.limit_s, log, env)
            results.append(result_of(step, code, seconds, log, suite_figures(log)))
        elif step.name == "bench":
            code, seconds = run([py, "scripts/bench.py", "--sizes", "124m,1.3b", "--json", str(out / "bench.json")], step.limit_s, log)
            results.append(result_of(step, code, seconds, log, bench_figures(out / "bench.json")))
        elif step.name == "train":
            metrics = out / "train.jsonl"
            cmd = [py, "train.py", *TRAIN, f"--checkpoint.save={save}", "--checkpoint.exit_interval=10",
                   f"--logging.metrics_file={metrics}"]  # fmt: skip
            code, seconds = run(cmd, step.limit_s, log)
            results.append(result_of(step, code, seconds, log, train_figures(metrics, 1)))
        elif step.name == "resume":
            metrics = out / "resume.jsonl"
            cmd = [py, "train.py", *TRAIN, f"--checkpoint.save={save}", f"--checkpoint.load={save}", "--checkpoint.async_save=true",
                   f"--logging.metrics_file={metrics}"]  # fmt: skip
            code, seconds = run(cmd, step.limit_s, log)
            figures = train_figures(metrics, 11)
            if code == 0 and not figures.startswith("iterations 11-20"):
                code, figures = 1, f"did not resume at 11: {figures or 'no metrics'}"
            results.append(result_of(step, code, seconds, log, figures))
    return results


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    problem = cuda_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.megatron_core:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", args.megatron_core], check=True)
    results = run_steps(args, out)
    table = summary_table(environment(), results)
    (out / "summary.md").write_text(table)
    print("\n" + table + f"\n(written to {out / 'summary.md'}; paste it under docs/performance.md's \"GPU check\")")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
