"""torch.compile of a model or pipeline stage: whole on one rank, per block once parallelised.

Per block, as torchtitan does, after TP and recomputation and before FSDP: the blocks are
identical, so one graph serves them all, and FSDP's hooks and the pipeline's send/recv stay
outside the compiled code. Compiling a whole tensor-parallel model also gives the right
gradients on CPU, but took ~4x longer to compile than per block (one 2-layer model: 381 s
against 86 s on two shared cores).

Under tensor parallelism the compiled code holds DTensor's collectives with the *name* of the
process group they run on ("12"). Inductor's on-disk caches (FX graph and AOTAutograd, on by
default, shared by every run of a user) key a graph without that name, so a run on another
mesh can be handed code that calls a group its own process never created (a crash:
"Could not resolve the process group registered under the name 12"), or one that exists there
with other ranks, silently computing wrong results: on this machine a tp2 run whose cache held
the graphs of a tp2+SP run trained with 25% wrong losses and no error. So a tensor-parallel
compile turns both caches off for the process; compile then costs its full time on every start.
`tests/test_compile.py` keeps a minimal reproduction that fails while torch has this defect.
"""

from __future__ import annotations

import torch
import torch._functorch.config
import torch._inductor.config

from dtgpt.model import GPT
from dtgpt.parallel.dims import ParallelDims


def turn_off_compile_caches() -> None:
    """No compiled graph is read from or written to inductor's on-disk caches in this process."""
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def apply_compile(model: GPT, dims: ParallelDims) -> None:
    """Compile in place (names keep no `_orig_mod` prefix): per block on a mesh, else whole."""
    if dims.tp_enabled:
        turn_off_compile_caches()
    if dims.tp_enabled or dims.pp_enabled or dims.fsdp_enabled:
        for block in model.layers.values():
            block.compile()
    else:
        model.compile()
