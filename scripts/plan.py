"""Plan a layout without GPUs: per-rank parameters and memory, pipeline bubble, training time.

    python scripts/plan.py --config configs/gpt3_175b.toml
    python scripts/plan.py --config configs/gpt3_175b.toml --world-size 1024 --training.recompute_granularity=full --training.recompute_method=uniform --training.recompute_num_layers=1
    python scripts/plan.py --config configs/gpt3_175b.toml --json --check    # exit 1 if a rank does not fit

Exit status: 0 (with --check: every rank fits), 1 (--check and a rank is over --gpu-memory-gib),
2 (the layout is impossible: a config or mesh rule fails).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtgpt.plan import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
