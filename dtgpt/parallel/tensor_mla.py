"""Multi-latent attention's tensor-parallel plan (dtgpt/mla.py), Megatron's split:

    down-projections (linear_q_down_proj, linear_kv_down_proj) and the norms after them:
        replicated weights on the block's own tokens (under sequence parallelism a rank's chunk),
        their gradients summed over tp (Megatron's duplicated Transformer Engine linears)
    up-projections (linear_q_up_proj or linear_q_proj, linear_kv_up_proj): column-parallel,
        each rank its heads; under sequence parallelism their input is all-gathered first
    the shared RoPE key (k_pos_emb): gathered whole on every rank (all-gathered under sequence
        parallelism), its gradient summed from every rank's heads
    linear_proj: row-parallel, as the dense attention's output projection

The activations between stay DTensors, so the sums the gradients need are DTensor's own.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle


class ReplicatedOnDTensors(ParallelStyle):
    """Parameters replicated over tp; the module takes and returns DTensors as they come (a
    sequence-parallel chunk, or the replicated sequence). No stock style leaves both as they are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class GatheredWhole(ParallelStyle):
    """The module's DTensor input made whole on every rank, and passed on as a local tensor whose
    gradient is partial (each rank's from its own heads): backward sums it over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module, inputs, _mesh):
            x = inputs[0]
            assert isinstance(x, DTensor), "the shared key arrives as a DTensor (a down-projection's output)"
            return (x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()]),)

        return distribute_module(module, device_mesh, input_fn=gather)


def mla_plan(prefix: str, attention: nn.Module, seq: Placement) -> dict[str, ParallelStyle]:
    """The plan of one block's MLASelfAttention (at prefix + "attention"); `seq` is the residual
    stream's layout (Shard(1) under sequence parallelism, else Replicate())."""
    at = prefix + "attention."
    plan: dict[str, ParallelStyle] = {
        prefix + "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,)),
        at + "linear_kv_down_proj": ReplicatedOnDTensors(),
        at + "linear_kv_up_proj": ColwiseParallel(input_layouts=seq),
        at + "k_pos_emb": GatheredWhole(),
        at + "linear_proj": RowwiseParallel(output_layouts=seq),
    }
    if attention.cfg.q_lora_rank is None:
        plan[at + "linear_q_proj"] = ColwiseParallel(input_layouts=seq)
    else:
        plan[at + "linear_q_down_proj"] = ReplicatedOnDTensors()
        plan[at + "linear_q_up_proj"] = ColwiseParallel(input_layouts=seq)
        if attention.q_layernorm is not None:
            plan[at + "q_layernorm"] = ReplicatedOnDTensors()
    if attention.kv_layernorm is not None:
        plan[at + "kv_layernorm"] = ReplicatedOnDTensors()
    return plan
