"""megatron-core's distributed optimizer on its MoE GPTModel: the oracle for an MoE model's Adam
state in Megatron's dp_reshardable layout (the experts' optimizer, chained_1, beside the dense one).

Called at the end of tests/megatron_moe_gpt.py's launch (2 gloo ranks), once at ep 2 (dense dp 2,
expert dp 1: each rank saves its own experts' buckets, chained_1) and once at ep 1 (dp 2; the
experts are not expert-parallel then, so megatron-core keeps them in the dense grad buffer, in
module order, and builds one optimizer: no chained_ prefix). Each time: one synthetic step (tests/megatron_adam.py's
gradient sin(7 w)) of a model whose grad buffers are one bucket each, saved in model space
(fully_reshardable: megatron-core gathers each parameter's state itself) under ROOT/adam_ep<N>,
and the same step of the same model cut into BUCKET_SIZE buckets saved dp_reshardable under
ROOT/adam_ep<N>/dp_reshardable: the same state in both layouts.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

BUCKET_SIZE = 6_000
"""Elements per grad bucket of the dp_reshardable save: several buckets in the dense buffer and in
each expert buffer (two experts of 2 layers, 4 x 2 x 32 x 64 elements at ep 2)."""


def save_moe_adam(root: Path, ep: int, build, state: dict) -> None:
    """The two saves of the module doc at expert parallelism `ep` (Megatron's groups set up for
    it); `build()` gives the seeded model, `state` Megatron-LM's common part."""
    from tests.megatron_adam import build_optimizer, save, synthetic_step

    for bucket_size, sharding, directory in ((None, "fully_reshardable", root), (BUCKET_SIZE, "dp_reshardable", root / "dp_reshardable")):
        model = build()
        distinct_experts(model, ep)
        ddp, optimizer = build_optimizer(model, bucket_size=bucket_size)
        # at ep > 1 the experts have an optimizer of their own (chained_1); at ep 1 the dense one holds them
        assert len(optimizer.chained_optimizers) == 1 + (ep > 1)
        # no clipping: its global norm sums the dense and the expert norms in an order that the
        # bucket count changes at ep 2, so the two saves would differ in the last bit
        optimizer.config.clip_grad = 0.0
        synthetic_step(model, ddp, optimizer)
        save(model, optimizer, directory, sharding, state)
    dist.barrier()


@torch.no_grad()
def distinct_experts(model, ep: int) -> None:
    """Each global expert's weights drawn from a seed of its own: megatron-core's CPU init draws
    the same local experts on every expert-parallel rank (expert 2 = expert 0 at ep 2), which
    would hide a state read from another rank's buffer."""
    from megatron.core import parallel_state

    for layer in model.decoder.layers:
        local = layer.mlp.experts.local_experts
        for k, expert in enumerate(local):
            draw = torch.Generator().manual_seed(100 + parallel_state.get_expert_model_parallel_rank() * len(local) + k)
            for param in expert.parameters():
                param.copy_(0.02 * torch.randn(param.shape, generator=draw))
