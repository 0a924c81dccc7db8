"""Selective recomputation of the submodules `training.recompute_modules` names (Megatron's names).

Two kinds, as Megatron's: a checkpointed submodule keeps only its input, and backward runs its
forward again (non-reentrant torch.utils.checkpoint, the forward's RNG state replayed):

core_attn       the attention core, softmax(q k^T) v (no projections): drops its scores
mlp             a dense block's MLP: keeps its input, drops fc1's output, the activation's
moe             an MoE block's whole MoE layer (router, dispatch, experts, combine, shared expert):
                keeps its input; under ep the recomputed forward exchanges its tokens again
shared_experts  an MoE layer's shared expert: keeps its input

and an output-discarding one (dtgpt.discard): an output kept only as its consumer's input is
released once the consumer has run, and computed again just before the consumer's backward:

layernorm       both norms of a block: their outputs (the QKV and fc1 matmuls' inputs); kept under
                sequence parallelism, where what those matmuls keep is the gathered input
mla_up_proj     multi-latent attention's up-projections and RoPE (run keeping nothing but their
                inputs) and their outputs q, k, v, which the attention core keeps; one run in
                backward refills q, k, v and gives the up-projections' backward its graph
moe_act         the experts' activation (checkpointed) and its output, fc2's input

The prediction modules' blocks (multi-token prediction) are treated as the model's, as Megatron's.
The module tree does not change: a checkpointed module's forward is wrapped in place, so
parameter names, FSDP units, tensor-parallel plans and checkpoints stay the same.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from dtgpt.mlp import MLP
from dtgpt.model import Block, GPT
from dtgpt.moe.layer import MoELayer
from dtgpt.mtp import named_blocks
from dtgpt.parallel.rng import ModelParallelRNG


def rng_replay(rng: ModelParallelRNG | None) -> dict:
    """checkpoint's keywords that replay the model-parallel RNG stream, when there is one."""
    return {"context_fn": rng.recompute_contexts} if rng is not None else {}


def _checkpoint_forward(module: torch.nn.Module, rng: ModelParallelRNG | None) -> None:
    forward, replay = module.forward, rng_replay(rng)

    def recomputed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **replay, **kwargs)

    module.forward = recomputed  # an instance attribute: nn.Module.__call__ finds it, hooks stay outside
    module.recomputed = True


def _checkpointed(module: torch.nn.Module | None) -> bool:
    return getattr(module, "recomputed", False)


def apply_module_recompute(model: GPT, modules: tuple[str, ...], rng: ModelParallelRNG | None = None) -> None:
    """Set up selective recomputation of `modules` in every block of one model or stage, in place."""
    for block in named_blocks(model).values():
        moe = block.mlp if isinstance(block.mlp, MoELayer) else None
        if "core_attn" in modules:  # no parameters: the wrapper's extra name level costs nothing
            block.attention.core = checkpoint_wrapper(block.attention.core, **rng_replay(rng))
        if "mlp" in modules and isinstance(block.mlp, MLP):
            _checkpoint_forward(block.mlp, rng)
        if "moe" in modules and moe is not None:
            _checkpoint_forward(moe, rng)
        if "shared_experts" in modules and moe is not None and moe.shared_expert is not None and not _checkpointed(moe):
            _checkpoint_forward(moe.shared_expert, rng)
        if "moe_act" in modules and moe is not None and not _checkpointed(moe):
            moe.experts.recompute_activation = True
        if "layernorm" in modules:
            block.discard_norm_outputs = True
        if "mla_up_proj" in modules and hasattr(block.attention, "recompute_up_proj"):
            block.attention.recompute_up_proj = True


def recomputed_modules(block: Block) -> tuple[str, ...]:
    """What selective recomputation recomputes in `block`, by Megatron's names: the planner reads it."""
    moe = block.mlp if isinstance(block.mlp, MoELayer) else None
    found = {
        "core_attn": isinstance(block.attention.core, CheckpointWrapper),
        "mlp": isinstance(block.mlp, MLP) and _checkpointed(block.mlp),
        "moe": _checkpointed(moe),
        "shared_experts": moe is not None and _checkpointed(moe.shared_expert),
        "layernorm": getattr(block, "discard_norm_outputs", False),
        "mla_up_proj": getattr(block.attention, "recompute_up_proj", False),
        "moe_act": moe is not None and moe.experts.recompute_activation,
    }
    return tuple(name for name, on in found.items() if on)
