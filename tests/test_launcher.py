"""`python -m dtgpt.run`: a failed worker is replaced alone, with its rank; anything else is torchrun's
full restart; bad flags are one line. The workers are a toy (tests/replace_worker.py), not train.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtgpt.run.__main__ import parse_launcher_args
from tests.runs import REPO

WORKER = str(REPO / "tests" / "replace_worker.py")
SAME_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(tmp_path: Path, mode: str, max_restarts: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dtgpt.run", "--standalone", "--nproc-per-node", "4", f"--max-restarts={max_restarts}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd + [WORKER, str(tmp_path), mode], env=env, capture_output=True, text=True, timeout=300)
    (tmp_path / "launcher.log").write_text(proc.stdout + proc.stderr)
    return proc


def starts(tmp_path: Path) -> dict[tuple[int, int, int], dict]:
    """(rank, restart count, replacement) -> what that process recorded when it started."""
    found = {}
    for path in tmp_path.glob("start-*.json"):
        rank, restart, replacement = map(int, path.stem.split("-")[1:])
        found[(rank, restart, replacement)] = json.loads(path.read_text())
    return found


def read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_a_killed_worker_is_replaced_alone_with_its_rank(tmp_path):
    proc = launch(tmp_path, "kill-once", max_restarts=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = starts(tmp_path)
    assert set(started) == {(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), (3, 0, 1)}  # no other process started
    for rank in range(3):  # each survivor saw the replacement from the process it started in
        saw = read(tmp_path / f"saw-{rank}-0-0.json")
        assert saw == {"pid": started[(rank, 0, 0)]["pid"], "replacing": "1"}
    first, second = started[(3, 0, 0)]["env"], started[(3, 0, 1)]["env"]
    assert started[(3, 0, 1)]["pid"] != started[(3, 0, 0)]["pid"]
    for name in SAME_ENV + tuple(k for k in first if k.startswith("TORCHELASTIC_")):
        assert second.get(name) == first[name], name
    assert first["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert second["DTGPT_REPLACEMENT"] == "1" and "DTGPT_REPLACEMENT" not in first
    assert all(s["env"]["DTGPT_LAUNCHER"] == "dtgpt.run" for s in started.values())
    assert "starting replacement 1 with the same rank" in proc.stderr
    # the agent names the worker once, by its own local rank (no per-process context's "local_rank: 0")
    assert f"worker 3 (local rank 3, pid {started[(3, 0, 0)]['pid']}) failed" in proc.stderr
    assert "local_rank:" not in proc.stderr


@pytest.mark.slow
def test_survivors_that_fail_after_a_replacement_get_a_full_restart(tmp_path):
    proc = launch(tmp_path, "survivors-fail", max_restarts=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = starts(tmp_path)
    first_round = {key: s["pid"] for key, s in started.items() if key[1] == 0}
    # the replacement counted as a restart: the new round is TORCHELASTIC_RESTART_COUNT 2
    restarted = {key: s["pid"] for key, s in started.items() if key[1] == 2}
    assert set(restarted) == {(rank, 2, 0) for rank in range(4)}
    assert not set(restarted.values()) & set(first_round.values())  # every worker is a new process
    assert set(started) == set(first_round) | set(restarted)


@pytest.mark.slow
def test_no_restart_left_fails_as_torchrun_does_and_tells_the_survivors(tmp_path):
    proc = launch(tmp_path, "kill-always", max_restarts=1)
    assert proc.returncode != 0
    assert "ChildFailedError" in proc.stderr and "Root Cause (first observed failure)" in proc.stderr
    assert "Signal 9 (SIGKILL)" in proc.stderr
    started = starts(tmp_path)
    assert set(started) == {(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), (3, 0, 1)}  # one replacement, then none
    for rank in range(3):  # stopped by the launcher, after it said no replacement would come
        assert read(tmp_path / f"sigterm-{rank}-0-0.json") == {"no_replacement": "restarts exhausted"}


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_worker(tmp_path):
    cmd = [sys.executable, "-m", "dtgpt.run", "--standalone", "--nproc-per-node", "4", "--max-restarts=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen(cmd + [WORKER, str(tmp_path), "sleep"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        while len(starts(tmp_path)) < 4 and launcher.poll() is None:
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        _out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0  # torchrun, too, exits non-zero on a signal
    assert "SignalException" in err
    assert sorted(p.name for p in tmp_path.glob("sigterm-*.json")) == [f"sigterm-{r}-0-0.json" for r in range(4)]
    assert set(starts(tmp_path)) == {(r, 0, 0) for r in range(4)}  # stopped, not replaced


@pytest.mark.slow
def test_a_config_error_is_one_line_and_neither_restarted_nor_replaced(tmp_path):
    """Every worker fails before its first iteration: the launcher stops, restarting and
    replacing nobody, and adds nothing to the worker's `error:` line (exit 2, as train.py's)."""
    cmd = [sys.executable, "-m", "dtgpt.run", "--standalone", "--nproc-per-node", "2", "--max-restarts=2",
           str(REPO / "train.py"), "--config", str(REPO / "configs" / "debug.toml"), "--data.mock_data=true",
           "--training.global_batch_size=7"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, lines
    assert lines == ["error: training.micro_batch_size=8 must divide training.global_batch_size=7"], lines


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc-per-node"], "argument --nproc-per-node/--nproc_per_node: expected one argument"),
        (["--bogus", "x.py"], "unrecognized arguments: --bogus"),
        (["--max-restarts=-1", "x.py"], "--max-restarts=-1: must be >= 0"),
        (["--nnodes=3:1", "x.py"], "--nnodes=3:1: need 0 < min <= max"),
        (["--nproc-per-node=0", "x.py"], "--nproc-per-node=0: must be >= 1"),  # torch asserted it at launch
    ],
)
def test_bad_flags_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_launcher_args(flags)  # what main does first: nothing has started yet
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"python -m dtgpt.run: error: {message}\n"
