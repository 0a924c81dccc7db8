"""A module run on plain tensors (this rank's own tokens) with parameters tp replicates.

For modules whose tokens differ per tp rank and whose computation is best left to local
tensors: an MoE layer's router and experts (routing, sorting and grouped GEMMs have no DTensor
sharding rules), and multi-latent attention's down-projections and their norms under sequence
parallelism (torch 2.11's DTensor cannot flatten a (batch, sequence-chunk) pair for a linear
layer; dtgpt/parallel/tensor_mla.py). No stock style runs a module on local tensors with
replicated parameters and sums their gradients.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle


class LocalReplicaParallel(ParallelStyle):
    """Parameters replicated over tp as DTensors; the module computes on plain tensors: its own
    tokens (a sequence-parallel chunk) with the local values of its parameters, whose gradients
    come back as pending sums over tp (Partial: reduce_pending_grads sums them once). Buffers
    (the expert bias) stay plain.

    placement: Shard(0) instead holds each rank's slice (the attention sink's logits of its own
    heads), whose gradients are that slice's, with nothing to sum.
    """

    def __init__(self, placement: Placement = Replicate()):
        super().__init__()
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Not distribute_module: it makes every buffer a DTensor too, and the router adds its
        # expert bias to plain scores.
        for sub in module.modules():
            for key, param in list(sub.named_parameters(recurse=False)):
                sub.register_parameter(key, nn.Parameter(distribute_tensor(param, device_mesh, [self.placement]), param.requires_grad))
        module.register_forward_pre_hook(_local_parameters)
        module.register_forward_hook(_replicated_parameters)
        return module


def _local_parameters(module: nn.Module, _inputs) -> None:
    # Swapped in place for the forward (FSDP has already put its gathered parameters there).
    module._replicas = []
    for sub in module.modules():
        for key, param in list(sub._parameters.items()):
            if isinstance(param, DTensor):
                module._replicas.append((sub, key, param))
                # Under expert parallelism the experts live on (ep, tp): sharded over ep, replicated over tp.
                sub._parameters[key] = param.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in param.placements])


def _replicated_parameters(module: nn.Module, _inputs, _output) -> None:
    for sub, key, param in module._replicas:
        sub._parameters[key] = param
    module._replicas = []
