"""Multi-latent attention's tensor-parallel plan (dtgpt/mla.py), Megatron's split:

    down-projections (linear_q_down_proj, linear_kv_down_proj) and the norms after them:
        replicated weights on the block's own tokens (under sequence parallelism a rank's chunk),
        their gradients summed over tp (Megatron's duplicated Transformer Engine linears)
    up-projections (linear_q_up_proj or linear_q_proj, linear_kv_up_proj): column-parallel,
        each rank its heads; under sequence parallelism their input is all-gathered first
    the shared RoPE key (k_pos_emb): gathered whole on every rank (all-gathered under sequence
        parallelism), its gradient summed from every rank's heads
    linear_proj: row-parallel, as the dense attention's output projection

Without sequence parallelism the activations between stay DTensors, so the sums the gradients
need are DTensor's own. Under it the down-projections and their norms compute on the rank's
chunk as plain tensors (LocalReplicaParallel; the up-projections and the RoPE key's gather take
it as the Shard(1) it is): a linear layer on a (batch, sequence) DTensor sharded on the sequence
flattens the two, which torch 2.13's DTensor records as a strided shard and torch 2.11's refuses.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from dtgpt.parallel.local_replica import LocalReplicaParallel


class ReplicatedOnDTensors(ParallelStyle):
    """Parameters replicated over tp; the module takes and returns DTensors as they come (the
    replicated sequence, without sequence parallelism). No stock style leaves both as they are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class GatheredWhole(ParallelStyle):
    """The module's input (a DTensor, or a local tensor laid out as `input_layout`) made whole on
    every rank, and passed on as a local tensor whose gradient is partial (each rank's from its
    own heads): backward sums it over tp."""

    def __init__(self, input_layout: Placement):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
            return (x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()]),)

        return distribute_module(module, device_mesh, input_fn=gather)


def mla_plan(prefix: str, attention: nn.Module, seq: Placement) -> dict[str, ParallelStyle]:
    """The plan of one block's MLASelfAttention (at prefix + "attention"); `seq` is the residual
    stream's layout (Shard(1) under sequence parallelism, else Replicate())."""
    at = prefix + "attention."
    sequence_parallel = isinstance(seq, Shard)
    replicated = LocalReplicaParallel if sequence_parallel else ReplicatedOnDTensors
    plan: dict[str, ParallelStyle] = {
        prefix + "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=sequence_parallel),
        at + "linear_kv_down_proj": replicated(),
        at + "linear_kv_up_proj": ColwiseParallel(input_layouts=seq),
        at + "k_pos_emb": GatheredWhole(seq),
        at + "linear_proj": RowwiseParallel(output_layouts=seq),
    }
    if attention.cfg.q_lora_rank is None:
        plan[at + "linear_q_proj"] = ColwiseParallel(input_layouts=seq)
    else:
        plan[at + "linear_q_down_proj"] = replicated()
        plan[at + "linear_q_up_proj"] = ColwiseParallel(input_layouts=seq)
        if attention.q_layernorm is not None:
            plan[at + "q_layernorm"] = replicated()
    if attention.kv_layernorm is not None:
        plan[at + "kv_layernorm"] = replicated()
    return plan
