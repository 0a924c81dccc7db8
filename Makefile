# `make train` and `make test` each set up .venv on first use, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; used only when the venv has no torch yet.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: train test test-all setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(PY) train.py --config configs/debug.toml

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	DTGPT_SLOW=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
