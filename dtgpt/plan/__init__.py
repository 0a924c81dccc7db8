"""Plan a layout on a laptop: per-rank parameters and memory, bubble, FLOPs and training time.

Every distinct (pp rank, tp rank) of the job is built on the meta device under PyTorch's "fake"
process group at the job's full world size, through the same `build_meta_parts()` -> `parallelize()`
code path that training runs (dtgpt.plan.ranks), so the parameter counts are those of the real
sharded DTensors. Nothing is allocated. Memory, bubble and time come from the formulas in
dtgpt.plan.activations and dtgpt.plan.memory.

    python scripts/plan.py --config configs/gpt3_175b.toml [--json] [--world-size N] [--check]
    python train.py --config configs/gpt3_175b.toml --dry-run

    results.py  the Plan and RankPlan records, LayoutError
    layout.py   plan_layout(): the inputs (vocabulary, world size), the build, the figures
    ranks.py    each distinct rank built on the fake process group
    activations.py  one layer's activation memory, term by term (Korthikanti et al.)
    memory.py   the other formulas (in-flight micro-batches, bubble, states, time)
    report.py   warnings and the per-rank table
    cli.py      the command line (scripts/plan.py, train.py --dry-run)

Imports run one way: cli -> layout -> ranks, activations, memory, report -> results.
"""

from dtgpt.plan.cli import cli, main
from dtgpt.plan.layout import default_world_size, layout_errors, plan_layout, tokenizer_vocab_size
from dtgpt.plan.results import LayoutError, Plan, RankPlan

__all__ = [
    "LayoutError", "Plan", "RankPlan", "cli", "default_world_size", "layout_errors", "main", "plan_layout",
    "tokenizer_vocab_size",
]  # fmt: skip
