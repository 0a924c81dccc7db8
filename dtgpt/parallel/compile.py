"""torch.compile of a model or pipeline stage: whole on one rank, per block once parallelised.

Per block, as torchtitan does, after TP and recomputation and before FSDP: the blocks are
identical, so one graph serves them all, and FSDP's hooks and the pipeline's send/recv stay
outside the compiled code. Compiling a whole tensor-parallel model also gave the right gradients
on CPU, but compiled far longer (381 s against 86 s per block, tp2 + SP on a loaded 2-core machine).

Under tensor parallelism the compiled code holds DTensor's collectives with the *name* of the
process group they run on ("12"). Inductor's AOTAutograd cache (on by default, on disk, shared by
every run of a user) keys a graph before DTensor's collectives are in it, without that name, so
a run on another mesh can be handed code that calls a group its own process never created (a
crash: "Could not resolve the process group registered under the name 12"), or one that exists
there with other ranks: a tp2 run, with the default caches filled by runs on other meshes,
trained with 25% wrong losses and no error. So a tensor-parallel compile turns that cache off
for the process. The FX graph cache stays on: it keys the graph with the collectives and their
group names in it, so a hit calls this process's own groups. `tests/test_compile.py` keeps a
minimal reproduction that fails while torch has this defect, and its parity tests share one
cache between launches on different meshes (they fail without this rule).

Dropout under tp: Megatron's masks come from eager's generators (the default one, identical on
every tp rank, and each rank's model-parallel stream forked around its own regions,
dtgpt/parallel/rng.py). Inductor would draw from philox streams of its own, so under tp with
dropout compiled code draws with eager's random ops instead (inductor's `fallback_random`): the
same masks as eager, which tests/test_compile.py checks on tp2.
"""

from __future__ import annotations

import torch
import torch._functorch.config
import torch._inductor.config

from dtgpt.model import GPT
from dtgpt.parallel.dims import ParallelDims


def draws_dropout(model: GPT) -> bool:
    """Whether any dropout of the model (hidden, embedding, attention) has a probability above 0."""
    return any(getattr(m, "p", 0.0) > 0.0 or getattr(m, "attention_dropout", 0.0) > 0.0 for m in model.modules())


def use_eager_random() -> None:
    """Compiled code draws its random numbers with eager's ops from eager's generators, so a
    compiled dropout draws exactly eager's masks (inductor's own philox streams would not)."""
    torch._inductor.config.fallback_random = True


def turn_off_autograd_cache() -> None:
    """No compiled graph is read from or written to the AOTAutograd cache in this process."""
    torch._functorch.config.enable_autograd_cache = False


def apply_compile(model: GPT, dims: ParallelDims, whole: bool = False) -> None:
    """Compile in place (names keep no `_orig_mod` prefix): per block on a mesh, else (or if
    `whole`: the compute copy of one process, dtgpt/parallel/compute_copy.py) whole."""
    if dims.tp_enabled:
        turn_off_autograd_cache()
        if draws_dropout(model):  # Megatron's per-tp-rank streams, as eager draws them (module doc)
            use_eager_random()
    # Static shapes: an evaluation recompiles the blocks (eval mode), and a recompile may otherwise
    # turn sizes symbolic, which DTensor's sharding rules reject ("unhashable type: non-nested SymInt").
    if not whole and (dims.tp_enabled or dims.pp_enabled or dims.fsdp_enabled):
        for block in model.layers.values():
            block.compile(dynamic=False)
    else:
        model.compile(dynamic=False)
