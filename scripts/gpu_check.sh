#!/usr/bin/env bash
# The first thing to run on a GPU machine, one command of at most 9 minutes (--budget-s, default 540 s): the
# one-GPU benchmark at 124m, 350m and 1.3b, eager and compiled; the tests marked cuda; a bf16 train.py run with a save, an async save and a resume; and a
# summary table for docs/performance.md. Arguments: scripts/gpu_check.py --help.
#   bash scripts/gpu_check.sh [--budget-s S] [--only bench-eager,bench-compiled,suite,train,resume] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PYTHON" scripts/gpu_check.py "$@"
