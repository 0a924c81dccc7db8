# `make train` and `make test` each set up .venv on first use, then run.
# torch: a venv that has none gets the pinned release (on a machine without CUDA pip serves it
# from the CPU wheel); a venv that already has a torch (CPU or CUDA, >= 2.11) keeps it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: train test test-fast setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(PY) train.py --config configs/debug.toml

# Every test, slow ones included (what CI runs); the slowest 15 are listed at the end.
test: $(STAMP)
	DTGPT_SLOW=1 $(PY) -m pytest -q --durations=15

# The edit-loop subset (about 4 minutes on 2 CPU cores): tests marked slow are skipped, leaving the
# unit tests and one end-to-end test per headline claim (the list: tests/conftest.py).
test-fast: $(STAMP)
	$(PY) -m pytest -q --durations=15

clean:
	rm -rf $(VENV) .pytest_cache
