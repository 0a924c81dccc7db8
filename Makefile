# `make train` and `make test` each set up .venv on first use, then run.
# torch: a venv that has none gets the pinned release (on a machine without CUDA pip serves it
# from the CPU wheel where its indexes offer one); a venv that already has a torch (CPU or CUDA,
# >= 2.11) keeps it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
# The oracle venv: megatron-core 0.19 (its current release) ships wheels for Python 3.12 only, and
# no CPU build of torch for 3.12 is on this project's package indexes: PyPI's Linux wheel is the
# CUDA build (its CUDA libraries 3.5 GB more). So `make test` keeps .venv on python3 and the CPU
# wheel (megatron-core 0.16.1 below 3.12), and `make test-oracle` runs every Megatron oracle test
# in .venv-oracle on Python 3.12 (on PATH or under pyenv) with megatron-core 0.19.2.
PYTHON312 := $(firstword $(foreach p,python3.12 $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.12*/bin/python3.12),$(shell $(p) -c 'print("$(p)")' 2>/dev/null)))
ORACLE_VENV := .venv-oracle
ORACLE_PY := $(ORACLE_VENV)/bin/python
ORACLE_STAMP := $(ORACLE_VENV)/.installed
# megatron-core 0.16.1 apart from the oracle venv, only for the batch-size ramp-up calculator that
# 0.17 removed (tests/test_megatron_oracle_schedules.py loads that one module file from here).
MCORE_0161 := .oracle/mcore-0.16.1
# emerging-optimizers, the math of megatron-core's Muon (tests/muon_oracle.py): pure Python but
# Python >= 3.12 only, so installed apart for .venv's 3.11 (tests/test_muon.py)
EMERGING_OPTIMIZERS := .oracle/emerging-optimizers
ORACLE_TESTS := tests/test_data_megatron_oracle.py tests/test_data_tokens_oracle.py tests/test_megatron_oracle_schedules.py \
	tests/test_loss_scaler.py tests/test_megatron_family.py tests/test_moe.py tests/test_megatron_checkpoint.py tests/test_megatron_checkpoint_resume.py \
	tests/test_megatron_moe_checkpoint.py tests/test_megatron_moe_tp2_adam.py tests/test_megatron_parallel_adam.py tests/test_training_controls.py tests/test_data_tokenizer.py \
	tests/test_data_tokenizer_sp_tiktoken.py tests/test_attention_variants.py tests/test_megatron_weight_decay.py tests/test_inits.py

# The torch floor: pyproject accepts torch>=2.11, so a subset of the suite that covers every torch
# subsystem dtgpt uses (DTensor TP, FSDP2, pipelining, DCP and async saves, torchrun ranks) runs
# on torch 2.11.0 in .venv-torch2.11. PyPI's 2.11.0 Linux wheel is the CUDA build (about 5 GB
# installed); it runs on CPU. megatron-core is left out (its tests skip).
FLOOR_TORCH := 2.11.0
FLOOR_VENV := .venv-torch$(basename $(FLOOR_TORCH))
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_TESTS := tests/test_config.py tests/test_model.py tests/test_library.py tests/test_checkpoint_unit.py tests/test_checkpoint_writes.py \
	tests/test_staging.py tests/test_devices.py tests/test_optim.py tests/test_precision.py \
	tests/test_pipeline_schedules.py tests/test_train.py tests/test_trajectory.py tests/test_rng.py tests/test_parity.py \
	tests/test_torch_cuda_apis.py tests/test_gpu_check.py tests/test_pipeline_buffers.py
# Slow parity cases that reach torch's private pipelining and functional-collective internals, each
# of which has differed between 2.11 and 2.13: a pipelined run, a context-parallel run and MoE
# routing statistics on a pipeline stage (against one process, on real gloo ranks); and the MoE
# token exchange (the autograd all-to-all on 2 and 4 ranks against the local dispatcher, ~1 min);
# and multi-latent attention on tp2 with and without SP (parity, and its saved activations at 2
# sequences per micro-batch: torch 2.11's DTensor cannot flatten a sequence-sharded (batch,
# sequence) pair for a linear layer, so under SP its down-projections compute on local tensors).
FLOOR_SLOW := tests/test_parity.py tests/test_moe_dispatch.py tests/test_parity_deepseek.py tests/test_activation_memory.py \
	-k "pp2_1f1b_tied or cp2_full_uniform_ac or moe_pp2_expert_bias_full_block_ac or all_to_all_equals_local or (mla and tp2)"

.PHONY: train test test-fast test-oracle test-no-megatron test-torch-floor gpu-check setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(EMERGING_OPTIMIZERS) --python-version 3.12 --only-binary=:all: emerging-optimizers==0.3.0
	touch $(STAMP)

$(ORACLE_STAMP): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: make test-oracle needs Python 3.12 (megatron-core 0.19 ships no other wheels)" >&2; exit 2; }
	test -x $(ORACLE_PY) || $(PYTHON312) -m venv $(ORACLE_VENV)
	$(ORACLE_PY) -m pip install --quiet --upgrade pip
	$(ORACLE_PY) -c "import torch" 2>/dev/null || $(ORACLE_PY) -m pip install --quiet $(TORCH_PIN)
	$(ORACLE_PY) -m pip install --quiet -e ".[dev]"
	$(ORACLE_PY) -m pip install --quiet --no-deps --upgrade --target $(MCORE_0161) megatron-core==0.16.1
	touch $@

$(FLOOR_STAMP): pyproject.toml
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet torch==$(FLOOR_TORCH)
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e . pytest tokenizers safetensors
	touch $@

setup: $(STAMP)

train: $(STAMP)
	$(PY) train.py --config configs/debug.toml

# Every test, slow ones included (what CI runs); the slowest 15 are listed at the end.
test: $(STAMP)
	DTGPT_SLOW=1 $(PY) -m pytest -q --durations=15

# The edit-loop subset (about 8 minutes wall on a busy 2-core machine): tests marked slow are skipped, leaving the
# unit tests and one end-to-end test per headline claim (the list: tests/conftest.py).
test-fast: $(STAMP)
	$(PY) -m pytest -q --durations=15

# The Megatron oracle tests against megatron-core 0.19.2 (and the ramp-up calculator of 0.16.1).
test-oracle: $(ORACLE_STAMP)
	DTGPT_SLOW=1 $(ORACLE_PY) -m pytest -q $(ORACLE_TESTS)

# The suite as on a machine without megatron-core (every import of it fails): the oracle tests
# skip with one line naming `pip install -e ".[dev]"` instead of failing at collection.
test-no-megatron: $(STAMP)
	$(PY) -m pytest -q -p tests.without_megatron $(ORACLE_TESTS) tests/test_megatron_checkpoint.py tests/test_model_family.py

test-torch-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -m pytest -q $(FLOOR_TESTS)
	DTGPT_SLOW=1 $(FLOOR_VENV)/bin/python -m pytest -q $(FLOOR_SLOW)

# The first thing to run on a GPU (one command of at most 9 minutes; scripts/gpu_check.sh --help).
# MEGATRON_WHEEL=path/to/megatron_core-*.whl installs the oracle first.
gpu-check: $(STAMP)
	PYTHON=$(PY) bash scripts/gpu_check.sh $(if $(MEGATRON_WHEEL),--megatron-core $(MEGATRON_WHEEL))

clean:
	rm -rf $(VENV) $(ORACLE_VENV) $(FLOOR_VENV) .oracle .pytest_cache
