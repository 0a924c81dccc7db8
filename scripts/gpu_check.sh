#!/usr/bin/env bash
# The first thing to run on a GPU machine (about 8 minutes on one H100): the test suite with CUDA
# visible, the one-GPU benchmark, a bf16 train.py run with a save, an async save and a resume, and a
# summary table for docs/performance.md. Arguments: scripts/gpu_check.py --help.
#   bash scripts/gpu_check.sh [--megatron-core WHEEL] [--only suite,bench,train,resume] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PYTHON" scripts/gpu_check.py "$@"
