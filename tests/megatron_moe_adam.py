"""megatron-core's distributed optimizer on its MoE GPTModel: the oracle for an MoE model's Adam
state in Megatron's dp_reshardable layout (the experts' optimizer, chained_1, beside the dense one).

Called at the end of tests/megatron_moe_gpt.py's launch (2 gloo ranks), once at ep 2 (dense dp 2,
expert dp 1: each rank saves its own experts' buckets, chained_1) and once at ep 1 (dp 2; the
experts are not expert-parallel then, so megatron-core keeps them in the dense grad buffer, in
module order, and builds one optimizer: no chained_ prefix). Each time: one synthetic step (tests/megatron_adam.py's
gradient sin(7 w)) of a model whose grad buffers are one bucket each, saved in model space
(fully_reshardable: megatron-core gathers each parameter's state itself) under ROOT/adam_ep<N>,
and the same step of the same model cut into BUCKET_SIZE buckets saved dp_reshardable under
ROOT/adam_ep<N>/dp_reshardable: the same state in both layouts. The same two saves at tp 2, for
expert tp 1 and 2 at ep 1 and 2 (save_moe_adam_tp2), and at pp 2, with virtual stages and at
tp 2 x pp 2 (save_moe_adam_pipeline), end tests/megatron_gpt.py's adam-parallel launch (4 gloo ranks).
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
    from megatron.core import parallel_state

    from tests.megatron_adam import build_optimizer, save, synthetic_step

    for bucket_size, sharding, directory in ((None, "fully_reshardable", root), (BUCKET_SIZE, "dp_reshardable", root / "dp_reshardable")):
        model = build()
        distinct_experts(model, ep)
        ddp, optimizer = build_optimizer(model, bucket_size=bucket_size)
        etp, tp = parallel_state.get_expert_tensor_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
        assert len(optimizer.chained_optimizers) == 1 + experts_apart(ep, etp, tp)
        # no clipping: its global norm sums the dense and the expert norms in an order that the
        # bucket count changes at ep 2, so the two saves would differ in the last bit
        optimizer.config.clip_grad = 0.0
        synthetic_step(model, ddp, optimizer)
        save(model, optimizer, directory, sharding, state)
    dist.barrier()


def experts_apart(ep: int, etp: int, tp: int) -> bool:
    """Whether megatron-core gives the experts an optimizer of their own (chained_1) beside the dense
    one: at ep > 1; and, after 0.16, wherever the expert tp differs from tp (their data-parallel
    group is not the dense one's: megatron-core 0.19.2 at tp 2 with expert tp 1). Else the dense one
    holds them."""
    from megatron.core.package_info import __version__

    return ep > 1 or (etp != tp and __version__ != "0.16.1")


@torch.no_grad()
def distinct_experts(model, ep: int) -> None:
    """Each global expert's weights, in each layer, drawn from a seed of its own: megatron-core's CPU
    init draws the same local experts on every expert-parallel rank (expert 2 = expert 0 at ep 2),
    and in every layer, which would hide a state read from another rank's buffer or layer."""
    from megatron.core import parallel_state

    from tests.megatron_adam import chunks_of

    for layer in (layer for chunk in chunks_of(model) for layer in chunk.decoder.layers):
        local = layer.mlp.experts.local_experts
        for k, module in enumerate(local):
            expert = parallel_state.get_expert_model_parallel_rank() * len(local) + k
            # each expert tp rank's shard a draw of its own too: a shard read from the wrong rank shows
            seed = 100 + expert + 1000 * parallel_state.get_expert_tensor_parallel_rank() + 10_000 * (layer.layer_number - 1)
            draw = torch.Generator().manual_seed(seed)
            for param in module.parameters():
                param.copy_(0.02 * torch.randn(param.shape, generator=draw))


TP2_LAYOUTS = ((1, 1), (1, 2), (2, 1), (2, 2))
"""(expert tp, ep) of the saves at tp 2 on 4 ranks (save_moe_adam_tp2): the experts whole on each
tp rank (expert tp 1, Mixtral's and DeepSeek's usual choice) or split as the dense MLP (expert tp =
tp, Megatron's default), in the dense buffer (ep 1; megatron-core 0.19 gives expert tp 1 a chained_1 of its own at ep 1 too)
or in their own (chained_1, ep 2)."""


def save_moe_adam_tp2(root: Path) -> None:
    """At tp 2 (4 gloo ranks, dense dp 2), for each of TP2_LAYOUTS: the two saves of the module doc
    under ROOT/etp<E>_ep<N> (patch_for_optimizer already run; the groups are set up here)."""
    from megatron.core import parallel_state

    from tests.megatron_moe_gpt import build, common

    for etp, ep in TP2_LAYOUTS:
        parallel_state.initialize_model_parallel(2, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        save_moe_adam(root / f"etp{etp}_ep{ep}", ep, lambda: build(ep, 1234, 2, etp), common(ep, 2, etp))  # noqa: B023
        parallel_state.destroy_model_parallel()


PIPELINE_LAYOUTS = (("vp", 1, 1, 2, 1), ("vp", 1, 1, 2, 2), ("tp2pp2", 2, 1, None, 2), ("tp2pp2", 2, 2, None, 1))
"""(name, tp, expert tp, virtual stages per pp rank, ep) of the saves at pp 2 on 4 ranks
(save_moe_adam_pipeline): with 2 virtual stages (4 layers, one a virtual stage; dense dp 2) at
ep 1 (the experts in each chunk's dense buffer) and ep 2 (in each chunk's chained_1 buffer), as
Megatron-MoE-ModelZoo's recipes run; and at tp 2 x pp 2 (2 layers, dp 1) with the experts whole
(expert tp 1, ep 2: chained_1 rank ep rank + 2 x pp rank) or split as the dense MLP (expert tp 2, ep 1)."""


def pipeline_layout_name(name: str, etp: int, ep: int) -> str:
    return f"moe_{name}/etp{etp}_ep{ep}"


def save_moe_adam_pipeline(root: Path) -> None:
    """At pp 2 (4 gloo ranks), for each of PIPELINE_LAYOUTS: the two saves of the module doc under
    ROOT/moe_<name>/etp<E>_ep<N> (patch_for_optimizer already run; the groups are set up here)."""
    from megatron.core import parallel_state

    from tests.megatron_moe_gpt import build, common

    for name, tp, etp, vp, ep in PIPELINE_LAYOUTS:
        layers = 2 * (vp or 1)
        parallel_state.initialize_model_parallel(tp, 2, virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp)  # fmt: skip
        state = common(ep, tp, etp)
        vars(state["args"]).update(pipeline_model_parallel_size=2, num_layers=layers, virtual_pipeline_model_parallel_size=vp)
        save_moe_adam(root / pipeline_layout_name(name, etp, ep), ep, lambda: build(ep, 1234, tp, etp, 2, vp, layers), state)  # noqa: B023
        parallel_state.destroy_model_parallel()
