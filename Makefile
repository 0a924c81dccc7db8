# `make train` and `make test` each set up .venv on first use, then run.
# torch: a venv that has none gets the pinned release (the CPU wheel where pip's indexes or
# find-links offer one for this Python, else PyPI's Linux wheel: the CUDA build, its CUDA
# libraries about 3.5 GB more); a venv that already has a torch (CPU or CUDA, >= 2.11) keeps it.
# Python 3.12 where the machine has one (on PATH or under pyenv): the tests' oracle, megatron-core
# 0.19, ships wheels for 3.12 only; elsewhere python3, and the oracle is megatron-core 0.16.1.
PYTHON312 := $(firstword $(foreach p,python3.12 $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.12*/bin/python3.12),$(shell $(p) -c 'print("$(p)")' 2>/dev/null)))
PYTHON ?= $(or $(PYTHON312),python3)
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
# megatron-core 0.16.1 apart from the venv, only for the batch-size ramp-up calculator that 0.17
# removed (tests/test_megatron_oracle_schedules.py loads that one module file from here).
MCORE_0161 := .oracle/mcore-0.16.1

.PHONY: train test test-fast setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

$(MCORE_0161)/.installed: $(STAMP)
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(MCORE_0161) megatron-core==0.16.1
	touch $@

setup: $(STAMP) $(MCORE_0161)/.installed

train: $(STAMP)
	$(PY) train.py --config configs/debug.toml

# Every test, slow ones included (what CI runs); the slowest 15 are listed at the end.
test: $(STAMP) $(MCORE_0161)/.installed
	DTGPT_SLOW=1 $(PY) -m pytest -q --durations=15

# The edit-loop subset (about 4 minutes on 2 CPU cores): tests marked slow are skipped, leaving the
# unit tests and one end-to-end test per headline claim (the list: tests/conftest.py).
test-fast: $(STAMP) $(MCORE_0161)/.installed
	$(PY) -m pytest -q --durations=15

clean:
	rm -rf $(VENV) .oracle .pytest_cache
