"""Activation recomputation with Megatron-LM's meanings (`recompute_granularity`, `_method`, `_num_layers`).

selective  in every block, the submodules training.recompute_modules names (Megatron's names;
           by default the attention core, softmax(q k^T) v: backward recomputes it instead of
           keeping its scores). dtgpt/parallel/recompute_modules.py says what each keeps.
full       whole blocks are recomputed in backward; only the input of each recomputed group is kept.
           uniform: all of a stage's blocks, in consecutive groups of recompute_num_layers.
           block:   the first recompute_num_layers blocks of each pipeline stage, one by one.

Blocks are counted within each stage (each model part), as Megatron counts within its
per-stage transformer block. Both use non-reentrant torch.utils.checkpoint, which replays the
forward's default RNG state; the model-parallel stream (dtgpt.parallel.rng), when there is one,
is replayed through checkpoint's `context_fn`, so dropout masks are the same in the recomputation.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from dtgpt.model import GPT
from dtgpt.parallel.recompute_modules import apply_module_recompute, recomputed_modules, rng_replay
from dtgpt.parallel.rng import ModelParallelRNG


class RecomputedGroup:
    """Consecutive blocks run as one unit whose activations backward recomputes from its input.

    A plain callable, not a module: the blocks stay registered where they are (`model.layers`),
    so parameter names, FSDP units and checkpoints do not change.
    """

    def __init__(self, names: list[str], blocks: list[torch.nn.Module], rng: ModelParallelRNG | None = None):
        self.names = names
        self.blocks = blocks
        self.checkpoint_kwargs = rng_replay(rng)

    def _run(self, h: torch.Tensor, **per_token) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, **per_token)
        return h

    def __call__(self, h: torch.Tensor, **per_token) -> torch.Tensor:
        """per_token: the blocks' position_ids and document_ids keywords, passed through."""
        return checkpoint(self._run, h, use_reentrant=False, **self.checkpoint_kwargs, **per_token)


def recompute_groups(names: list[str], method: str, num_layers: int) -> list[list[str]]:
    """The groups of a stage's blocks (`names`, in order) that full recomputation checkpoints."""
    if method == "uniform":
        return [names[i : i + num_layers] for i in range(0, len(names), num_layers)]
    return [[name] for name in names[:num_layers]]  # "block"


def apply_recompute(
    model: GPT,
    granularity: str | None,
    method: str | None,
    num_layers: int | None,
    rng: ModelParallelRNG | None = None,
    modules: tuple[str, ...] = ("core_attn",),
) -> None:
    """Set up recomputation on one model or pipeline stage in place (granularity None: none);
    `modules`: what 'selective' recomputes."""
    if granularity == "selective":
        apply_module_recompute(model, modules, rng)
    elif granularity == "full":
        names = list(model.layers)
        groups = recompute_groups(names, method, num_layers)
        covered = sum(len(g) for g in groups)  # groups cover a prefix of the stage's blocks
        runs = [RecomputedGroup(g, [model.layers[n] for n in g], rng) for g in groups]
        model.block_runs = runs + [model.layers[n] for n in names[covered:]]


def block_recompute(model: GPT) -> dict[str, str]:
    """How each block of `model` is recomputed ('full', 'selective' or 'none'): the planner reads it."""
    full = {n for run in model.block_runs or [] if isinstance(run, RecomputedGroup) for n in run.names}
    return {
        name: "full" if name in full else "selective" if recomputed_modules(block) else "none"
        for name, block in model.layers.items()
    }


def recompute_group_sizes(model: GPT) -> list[int]:
    """The blocks in each recomputed group of `model`: a group keeps only its input."""
    return [len(run.names) for run in model.block_runs or [] if isinstance(run, RecomputedGroup)]


def largest_recompute_group(model: GPT) -> int:
    """Blocks recomputed at once in backward: their full activations live together for a moment."""
    return max(recompute_group_sizes(model), default=0)
