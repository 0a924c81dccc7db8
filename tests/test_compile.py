"""torch.compile under tensor and pipeline parallelism trains the same model as one eager process.

Each compiled layout (per-block compile, dtgpt/parallel/compile.py) trains the tiny fp32 GPT of
tests/compile_worker.py for a few iterations; its loss, gradient norm and every gathered gradient
after each step, every parameter after the last (tests/parity_oracle.py), and the loss of an
evaluation after them (which recompiles the blocks in eval mode), must match one eager process
to relative 1e-5. Config validation allows compile with tp or pp exactly where these layouts
cover it (tp2 + SP alone and pp2 alone inside the pairs: LAUNCHES). Every layout compiles into
one inductor cache directory (its own, not the machine's): without the cache rule of
apply_compile, dp2 x tp2 + SP is handed the graphs of pp2 x tp2 + SP and stops ("Could not
resolve the process group registered under the name 12"; see
test_inductor_cache_keeps_the_process_group below).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.compile_worker import MODEL
from tests.parity_oracle import assert_params_match
from tests.runs import REPO

pytestmark = pytest.mark.slow  # minutes of inductor compilation

RTOL = 1e-5
WORKER = str(REPO / "tests" / "compile_worker.py")
LAUNCHES = {
    # launch: (ranks, layouts compiled in it). tp2 + SP alone and pp2 alone are each inside a pair
    # here: pp2 x tp2 + SP compiles tp + SP blocks without FSDP (dp 1), as tp2 + SP alone does, and
    # pp2 x dp2 compiles plain blocks on 1F1B stages, as pp2 alone does (FSDP wraps them after).
    "4 ranks": (4, ["pp2_tp2_sp", "dp2_tp2_sp", "dp2_tp2", "pp2_dp2"]),
    # Dropout under tp after the MoE blocks (no tp): compiled after tp layouts in one process,
    # torch 2.13 failed ("device_mesh._get_submesh is not an OpOverload"), a case train.py (one
    # layout) never meets, so no other tp layout shares this launch.
    "2 ranks": (2, ["moe_dp2", "tp2_dropout_eager", "tp2_dropout"]),
}


def launch(args: list[str], nproc: int, cache_dir) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    return subprocess.run(launcher + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def run_worker(layouts: str, nproc: int, out, cache_dir, *flags: str) -> None:
    proc = launch([WORKER, layouts, "--out", str(out), *flags], nproc, cache_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One inductor cache for every launch here, and not the machine's shared one."""
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(scope="module")
def results(tmp_path_factory, cache_dir):
    """layout -> {"losses", "grads"}: the eager reference first, then the launches as they run."""
    out = tmp_path_factory.mktemp("compile")
    run_worker("single,moe_single", 1, out, cache_dir, "--eager")
    failures: dict[str, str] = {}  # each launch runs once; its layouts share its outcome

    def get(layout: str) -> dict:
        name = next((n for n, (_, names) in LAUNCHES.items() if layout in names), None)
        if name is not None and name not in failures:
            failures[name] = ""
            ranks, names = LAUNCHES[name]
            try:
                run_worker(",".join(names), ranks, out, cache_dir)
            except AssertionError as e:
                failures[name] = str(e)
        if name is not None and failures[name]:
            pytest.fail(f"the launch on {name} failed: {failures[name]}")
        return torch.load(out / f"{layout}.pt")

    return get


def assert_matches(got: dict, want: dict) -> None:
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=RTOL), "evaluation loss"
    assert len(got["losses"]) == len(want["losses"])
    for it, (g, w) in enumerate(zip(got["losses"], want["losses"]), start=1):
        assert g == pytest.approx(w, rel=RTOL), f"iteration {it}: loss {g} vs eager one-process {w}"
    for it, (g, w) in enumerate(zip(got["grad_norms"], want["grad_norms"]), start=1):
        assert g == pytest.approx(w, rel=RTOL), f"iteration {it}: grad_norm {g} vs eager one-process {w}"
    for it, (grads, expected) in enumerate(zip(got["grads"], want["grads"]), start=1):
        assert set(expected) <= set(grads), f"iteration {it}: gradients missing: {set(expected) - set(grads)}"
        for name, ref in expected.items():
            diff = (grads[name] - ref).abs().max().item()
            assert diff <= RTOL * ref.abs().max().item(), f"iteration {it}: gradient of {name} off by {diff:.3g}"
    params = dict(got["params"])
    if "output.weight" in params and "output.weight" not in want["params"]:
        # a pipeline's last stage holds its own copy of the tied embedding, kept bitwise equal
        assert torch.equal(params.pop("output.weight"), params["embedding.word.weight"]), "tied copies differ"
    assert_params_match(params, want["params"], heads=MODEL["num_attention_heads"], rtol=RTOL)


@pytest.mark.parametrize("layout", LAUNCHES["4 ranks"][1])
def test_compiled_layout_matches_eager_single_process(results, layout):
    assert_matches(results(layout), results("single"))


def test_compiled_moe_blocks_match_eager_single_process(results):
    """MoE blocks compiled one by one under FSDP (dp2), against the eager one-process run: router,
    dispatch (sync-free, nonzero_static), looped experts and combine, with the router losses."""
    assert_matches(results("moe_dp2"), results("moe_single"))


def test_compiled_dropout_under_tp_draws_eager_masks(results):
    """Dropout 0.1 under tp2 (no SP: hidden dropout on the replicated default stream inside the
    compiled blocks, attention dropout on each rank's own stream), compiled, trains as eager tp2
    with the same streams: the same masks (dtgpt/parallel/compile.py). Inductor's own random
    streams would not: the losses move in the third decimal, gradients by 100%. Compiled against
    eager reorders float sums (1e-6 relative), which the first Adam step (lr 1e-2 divides by each
    gradient's own scale) grows to 5e-4 of a tensor's largest gradient by the second iteration:
    the losses and norms of every iteration, the first iteration's gradients, the evaluation and
    the final parameters are compared, each at what reordering leaves."""
    eager, compiled = results("tp2_dropout_eager"), results("tp2_dropout")
    assert all(abs(a - b) > 1e-4 for a, b in zip(eager["losses"], results("single")["losses"]))  # dropout is on
    for key in ("losses", "grad_norms"):
        assert compiled[key] == pytest.approx(eager[key], rel=RTOL), key
    for name, ref in eager["grads"][0].items():
        diff = (compiled["grads"][0][name] - ref).abs().max().item()
        assert diff <= RTOL * ref.abs().max().item(), f"iteration 1: gradient of {name} off by {diff:.3g}"
    assert compiled["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-4)
    assert_params_match(dict(compiled["params"]), eager["params"], heads=MODEL["num_attention_heads"], rtol=1e-3)


class StaleProcessGroup(Exception):
    """A compiled graph from the cache called a process group of another run."""


@pytest.mark.xfail(
    # torch 2.11 keys it with the group (the test passes there): the bug came with a later torch.
    condition=tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13),
    strict=True,
    raises=StaleProcessGroup,
    reason="torch 2.13: the AOTAutograd cache keys a compiled DTensor graph without its process group, "
    "so dtgpt.parallel.compile turns it off under tp; a pass means torch fixed it",
)
def test_inductor_cache_keeps_the_process_group(tmp_path):
    """tests/compile_cache_worker.py: the same compiled function on a second group of the same ranks."""
    proc = launch([str(REPO / "tests" / "compile_cache_worker.py")], 2, tmp_path)
    output = proc.stdout + proc.stderr
    if "Could not resolve the process group registered under the name" in output:
        raise StaleProcessGroup(output[-2000:])
    assert proc.returncode == 0, output[-6000:]  # any other failure is a real one
