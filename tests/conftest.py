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
