"""Test-suite settings.

Two sets. `make test` (what CI runs) sets DTGPT_SLOW=1 and runs every test. `make test-fast` and a
bare `pytest` skip the tests marked `slow`: what remains is the edit loop, about 8 minutes on a busy 2-core
machine: the unit tests, plus one end-to-end test for each headline claim:

- installs and runs on a CPU: test_readme.py's `make train` (a tiny training run, as written)
- every parallel layout trains the same model: test_parity.py's configs/debug_3d.toml
  (pp2 x dp2 x tp2 + SP on 8 ranks against one process)
- Megatron's data order sample for sample: test_data_megatron_oracle.py (megatron-core's datasets)
- Megatron's checkpoints: test_megatron_checkpoint.py's round trip (dtgpt -> Megatron tp 2 ->
  megatron-core's logits -> dtgpt)
- bytes moved against Megatron: test_comm_model.py (the formula against Megatron's collectives;
  test_comm_counts.py, slow, counts real ones)
- fault handling: faults/test_recovery.py's SIGKILL mid-iteration, restart and bitwise resume
- the 175B layout planned without a GPU: test_plan.py's 175B plan
- one GPU as fast as plain PyTorch: test_bench.py's check that the benchmark's plain-PyTorch
  reference computes dtgpt's losses (no timing on a CPU)
- the README's commands: test_readme.py (every command has a run; `make train` and --print-config)

Mark a test `slow` (`@pytest.mark.slow`, or `pytestmark` for a whole module) when it launches
train.py, torchrun or megatron-core for more than a few seconds and is not one of the above.

Where tests run: on CPU, whatever the machine has. The suite's expectations are CPU numerics
(pinned trajectories, the CPU RNG, bitwise comparisons, gloo ranks), so every test runs with CUDA
hidden, from itself and from the processes it starts (cpu_only below); a test of CUDA itself is
marked `cuda` and is skipped where there is none.

megatron-core is the oracle of the `dev` extra: without it, a test module that imports it, or a
test that does, is skipped with one line naming the install (not a collection error).
"""

import importlib.util
import os

import pytest
import torch

CUDA_PRESENT = torch.cuda.is_available()
MEGATRON_MISSING = 'megatron-core is not installed: pip install -e ".[dev]" (the Megatron oracle tests need it)'


def megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("cuda") and not CUDA_PRESENT:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    if os.environ.get("DTGPT_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason=SLOW_REASON)
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


SLOW_REASON = "slow: set DTGPT_SLOW=1 (make test) to run"


def pytest_terminal_summary(terminalreporter):
    """One line for the tests skipped as slow, one per other skip (pyproject's addopts asks pytest
    itself for failures and errors only)."""
    skipped = terminalreporter.stats.get("skipped", [])
    slow = [r for r in skipped if SLOW_REASON in str(r.longrepr)]
    for report in skipped:
        if report not in slow:
            path, line, reason = report.longrepr if isinstance(report.longrepr, tuple) else (report.nodeid, 0, report.longrepr)
            where = os.path.relpath(path, terminalreporter.config.rootpath) if os.path.isabs(path) else path
            terminalreporter.write_line(f"SKIPPED {where}:{line}: {reason.removeprefix('Skipped: ')}")
    if slow:
        terminalreporter.write_line(f"{len(slow)} tests marked slow skipped: set DTGPT_SLOW=1 (make test) to run them")


def _is_missing_megatron(error: BaseException | None) -> bool:
    return isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "megatron"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test module that imports megatron-core (itself or through a tests/ helper) is skipped
    where it is not installed."""
    report = yield
    if report.failed and isinstance(collector, pytest.Module) and not megatron_installed():
        error = getattr(getattr(report, "longrepr", None), "errorstring", "") or str(report.longrepr)
        if "No module named 'megatron" in error:
            report.outcome, report.longrepr = "skipped", (str(collector.path), 0, f"Skipped: {MEGATRON_MISSING}")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that imports megatron-core inside its body is skipped where it is not installed."""
    try:
        return (yield)
    except ModuleNotFoundError as error:
        if _is_missing_megatron(error) and not megatron_installed():
            pytest.skip(MEGATRON_MISSING)
        raise


@pytest.fixture(autouse=True)
def cpu_only(request, monkeypatch):
    """Hide CUDA from a test not marked `cuda`: torch.cuda answers "none" in this process, and
    CUDA_VISIBLE_DEVICES="" hides it from the processes the test starts (train.py, torchrun)."""
    if request.node.get_closest_marker("cuda"):
        yield
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    yield


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that leaves this process's default group initialised fails (and the group is
    destroyed), so that the next test that builds one does not fail in its place."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group initialised: call dtgpt.shutdown() (or destroy_process_group) at its end")


@pytest.fixture(scope="session")
def adam_tp2pp2(tmp_path_factory):
    """megatron-core's distributed optimizer at tp 2 x pp 2 after one step, for each of
    PARALLEL_ADAM's models (root/<arch>) and, with virtual pipeline stages, VIRTUAL_ADAM's
    (root/gpt_vp): model space and, under dp_reshardable/, its buckets (tests/megatron_gpt.py
    adam-parallel); in the same 4-rank launch, the MoE model at tp 2 (root/moe_tp2), at pp 2 with
    virtual stages (root/moe_vp) and at tp 2 x pp 2 (root/moe_tp2pp2) (tests/megatron_moe_adam.py).
    One launch, shared by the test modules that read it."""
    from tests.megatron_oracle import run_megatron_gpt

    root = tmp_path_factory.mktemp("megatron_adam_tp2pp2")
    run_megatron_gpt("adam-parallel", root, 4)
    return root


@pytest.fixture(scope="session")
def megatron_steps(tmp_path_factory):
    """megatron-core's checkpoint, and its weights after three SGD steps (sgd.pt) and after three
    Muon steps from the same weights (muon.pt, where emerging-optimizers is installed), its Muon
    chain saved after the first of them under muon_ckpt/ (tests/megatron_muon.py step_muon); and
    dtgpt's own Muon checkpoint (dtgpt/), written as Megatron's (from_dtgpt/) before the launch and
    loaded into megatron-core's Muon chain by it (loaded_muon.pt): one launch, shared by
    tests/test_sgd.py and tests/test_megatron_muon_checkpoint.py."""
    from tests.megatron_muon import write_dtgpt_muon
    from tests.megatron_oracle import run_megatron_gpt

    root = tmp_path_factory.mktemp("megatron_sgd")
    write_dtgpt_muon(root)
    run_megatron_gpt("sgd", root, 1)
    return root


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """Each architecture saved by megatron-core at tp 2 as torch_dist, with its logits, and the
    Llama-style one in the per-rank format too (tests/megatron_gpt.py FAMILY), and its Muon
    chain's state at tp 2 under llama_muon/ (tests/megatron_muon.py save_muon_tp2), in one launch,
    shared by tests/test_megatron_family.py and tests/test_megatron_muon_checkpoint.py."""
    from tests.megatron_oracle import run_megatron_gpt

    root = tmp_path_factory.mktemp("megatron_family")
    run_megatron_gpt("family", root, 2)
    return root


@pytest.fixture(scope="session")
def mla_root(tmp_path_factory):
    """dtgpt's checkpoints of the multi-latent attention + MoE + MTP model converted to Megatron's
    formats, and megatron-core's launch at tp 2 that saves its own, loads dtgpt's and records its
    logits, losses and Adam steps (tests/megatron_mla_oracle.py). One launch, shared by the test
    modules that read it."""
    from tests.megatron_mla_oracle import launch_mla_oracle

    root = tmp_path_factory.mktemp("megatron_mla")
    launch_mla_oracle(root)
    return root
