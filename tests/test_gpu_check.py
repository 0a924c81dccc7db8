"""scripts/gpu_check.py, the parts a CPU can check: its arguments, its refusal without CUDA, the
budget split (each step cut at its share, what is left reported as not run), the table rewritten
after each step, the flat output folder, the commands bench.py accepts, and the figures it reads
back, with stand-in steps for the GPU ones."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    """scripts/<name>.py as a module, registered first (its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
figures = _load("gpu_check_figures")


def _task(name: str, code: str, share: int = 1, **kw):
    return gpu_check.Task(gpu_check.Step(name, share, ""), [sys.executable, "-c", code], **kw)


def test_without_cuda_it_stops_at_once_with_one_line(capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: gpu_check needs a CUDA device") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, says",
    [(["--only", "suite,benchmark"], "unknown step 'benchmark'"), (["--only", ","], "unknown step ''"), (["--only", "resume"], "name train too"),
     (["--budget-s", "5"], "--budget-s: 5 is under 10"), (["--megatron-core", "nowhere.whl"], "nowhere.whl: no such file")],
)  # fmt: skip
def test_bad_arguments_are_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_benchmark_comes_first_and_the_default_fits_one_command():
    assert [s.name for s in gpu_check.STEPS] == ["bench-eager", "bench-compiled", "suite", "train", "resume"]
    assert gpu_check.DEFAULT_BUDGET_S == 540  # a 600 s command, with the start-up and the kill inside it
    assert gpu_check.limits(gpu_check.build_tasks(["suite", "train"], Path("o"), Path("w")), 240) == [140, 100]


def test_a_step_is_cut_at_its_share_and_a_failed_need_is_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0.5)
    snapshot = f"print(open({str(tmp_path / 'summary.md')!r}).read())"  # what the table said when it started
    tasks = [
        _task("quick", "print('ok')"),
        _task("slow", snapshot + "; import time; time.sleep(60)"),
        _task("broken", "import sys; print('boom'); sys.exit(3)"),
        _task("after", "print('never')", needs="broken"),
    ]
    # 3 s a step: a bare python's start-up (quick, broken) fits with room to spare on a loaded machine
    results = gpu_check.run_tasks(tasks, 12.0, tmp_path, "GPU check, stand-ins")
    assert [r.status for r in results] == ["passed", "cut", "FAILED", "not run"]
    quick, slow, broken, after = results
    assert 2.5 < slow.seconds < 25 and slow.detail.startswith("cut at its ")  # its 3 s share and most of quick's
    assert broken.detail == "exit 3: boom" and after.detail == "broken did not pass"
    assert "| quick | passed |" in (tmp_path / "slow.log").read_text() and "| broken | pending |" in (tmp_path / "slow.log").read_text()
    table = (tmp_path / "summary.md").read_text()
    assert table.startswith("GPU check, stand-ins\n\nbudget 12 s: quick 3, slow 3, broken 3, after 3\n")
    assert "| after | not run | 0 | broken did not pass |" in table and "1 of 4 steps passed" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.log", "quick.log", "slow.log", "summary.md"]


def test_a_cut_kills_the_steps_whole_process_group(tmp_path):
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print(p.pid, flush=True); time.sleep(60)")  # fmt: skip
    assert gpu_check.run([sys.executable, "-c", code], 3, tmp_path / "log")[0] is None
    child = Path(f"/proc/{(tmp_path / 'log').read_text().split()[0]}/status")
    for _ in range(100):  # a killed process leaves /proc once it is reaped
        if not child.exists() or "zombie" in child.read_text():
            break
        time.sleep(0.1)
    assert not child.exists() or "zombie" in child.read_text()


def test_when_the_budget_is_spent_the_rest_is_not_run(tmp_path):
    times = iter([0.0, 0.0, 100.0])  # the start, the first step's start, the second's: past the deadline
    results = gpu_check.run_tasks([_task("a", "pass"), _task("b", "pass")], 40.0, tmp_path, "h", clock=lambda: next(times))
    assert [(r.status, r.detail) for r in results] == [("passed", ""), ("not run", "0 s of the budget left for it")]


def test_the_real_steps_write_at_most_8_flat_files_and_bench_accepts_their_arguments(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    tasks = gpu_check.build_tasks([s.name for s in gpu_check.STEPS], out, work)
    written = {f"{t.step.name}.log" for t in tasks} | {"summary.md"}
    written |= {Path(a).name for t in tasks for a in t.cmd if a.startswith(str(out))}
    assert len(written) <= 8 and all(not a.startswith(str(out)) or Path(a).parent == out for t in tasks for a in t.cmd)
    bench = _load("bench")
    for task, compiled in zip(tasks[:2], (False, True)):
        args = bench.parse_args(task.cmd[2:])
        assert args.sizes == ["124m", "350m", "1.3b"] and args.compile is compiled and args.profile and args.json.startswith(str(out))
    assert " ".join(tasks[2].cmd[-3:]) == "-m cuda tests" and tasks[2].env["DTGPT_SLOW"] == "1"
    assert tasks[4].needs == "train" and tasks[4].verify("iterations 1-20, loss") and tasks[4].verify("iterations 11-20, loss") is None


def test_the_figures_and_the_table_from_a_partial_benchmark(tmp_path):
    suite = tmp_path / "suite.log"
    suite.write_text("....\n==== 5 passed, 1 skipped in 41.5s ====\n")
    assert figures.suite_figures(suite) == "5 passed, 1 skipped in 41.5s"
    profile = {"kernels": 900.0, "busy": 0.912, "optimizer_ms": 1.04}
    side = {"tokens_per_s": 480000.0, "mfu": 0.412, "profile": profile}
    bench = tmp_path / "bench-compiled.json"  # stopped after the first of three sizes
    bench.write_text(json.dumps({"complete": False, "sizes": ["124m", "350m", "1.3b"],
                                 "results": {"124m": {"ratio": 1.031, "dtgpt": side, "reference": {**side, "mfu": 0.4}}}}))  # fmt: skip
    assert figures.bench_figures(bench) == "124m: ratio 1.031, MFU 41.2%; 350m: not reached; 1.3b: not reached"
    assert figures.bench_table(bench, "compiled") == [
        "| 124m | compiled | 480,000 | 480,000 | **1.031** | 41.2 / 40.0 % | 900 / 900 | 91 / 91 % | 1.04 / 1.04 |"
    ]
    metrics = tmp_path / "resume.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i, "loss": 5.0 - i / 10, "tokens_per_s": 1000.0 * i}) + "\n" for i in range(11, 21)))
    assert figures.train_figures(metrics, 11) == "iterations 11-20, loss 3.9000 -> 3.0000, 16,000 tokens/s"
    table = gpu_check.summary_table("h", [gpu_check.Result("bench-compiled", "cut", 260, figures.bench_figures(bench), "cut at its 260 s")],
                                    tmp_path, 540, [260])  # fmt: skip
    assert "| bench-compiled | cut | 260 | cut at its 260 s; 124m: ratio 1.031, MFU 41.2%; 350m: not reached" in table
    assert table.endswith("|---|---|---:|---:|---:|---|---|---|---|\n" + figures.bench_table(bench, "compiled")[0] + "\n")


def test_main_runs_the_chosen_steps_in_the_budget_and_prints_the_table(tmp_path, monkeypatch, capsys):
    """main() end to end on a CPU: CUDA and the steps stood in for, the rest as on a GPU."""
    monkeypatch.setattr(gpu_check, "cuda_problem", lambda: None)
    monkeypatch.setattr(gpu_check, "environment", lambda: gpu_check.Environment("today", "Stand-in GPU", "2.x"))
    chosen = []

    def stand_ins(names, out, work):
        chosen.append((names, work))
        return [_task(n, f"open({str(work / n)!r}, 'w').write('x')", share=s.share_s) for n, s in zip(names, gpu_check.STEPS)]

    monkeypatch.setattr(gpu_check, "build_tasks", stand_ins)
    out, work = tmp_path / "out", tmp_path / "work"
    assert gpu_check.main(["--out", str(out), "--work", str(work), "--budget-s", "60", "--only", "suite,train"]) == 0
    assert chosen == [(["suite", "train"], work)] and sorted(p.name for p in work.iterdir()) == ["suite", "train"]
    printed = capsys.readouterr().out
    assert printed.startswith("GPU check, today: Stand-in GPU, torch 2.x, megatron-core not installed\n")
    assert "suite: passed in " in printed and "2 of 2 steps passed" in printed and (out / "summary.md").read_text() in printed
