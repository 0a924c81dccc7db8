"""Test-suite settings: slow tests run only with DTGPT_SLOW=1 (`make test` sets it; `make test-fast`
and a bare `pytest` skip them)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DTGPT_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: set DTGPT_SLOW=1 (make test) to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that leaves this process's default group initialised fails (and the group is
    destroyed), so that the next test that builds one does not fail in its place."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group initialised: call dtgpt.shutdown() (or destroy_process_group) at its end")
