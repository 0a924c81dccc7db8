"""Megatron's --check-weight-hash-across-dp-replicas-interval
(`training.check_weight_hash_across_dp_replicas_interval`): every that many iterations, the ranks
of one dp_replicate group (which hold the same shards of the same weights) compare a SHA-256 of
their local weights, and a difference stops the run: replicas that drift apart mean a gradient
was not reduced the same everywhere, a bug, not a fault to retry. Each rank hashes only its own
shards, so the check reads no more than what the rank holds (one copy to host memory).

Expert weights are left out when experts are split over ranks (expert_model_parallel_size > 1):
their placement over the data-parallel ranks is not the replicas' one.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over the names and local bytes of the given tensors, in their order."""
    digest = hashlib.sha256()
    for name, tensor in named:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        digest.update(name.encode())
        digest.update(local.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_replicas(named: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup, iteration: int) -> None:
    """Raise on every rank of `group` unless all of them hold the same weights."""
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, weights_digest(named), group=group)
    if len(set(digests)) > 1:
        differing = [i for i, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(
            f"iteration {iteration}: the weights of the data-parallel replicas differ (replica ranks {differing} of "
            f"the dp_replicate group against replica 0): their gradients were not reduced alike"
        )


def check_weight_hash(model, interval: int, iteration: int) -> None:
    """The check at `iteration`, when `interval` says so and there are replicas to compare."""
    dims = model.dims
    if not interval or iteration % interval or dims.dp_replicate == 1 or dims.sub("dp_replicate") is None:
        return
    named = [(n, p) for part in model.parts for n, p in part.named_parameters() if dims.ep == 1 or ".experts." not in n]
    check_replicas(named, dims.sub("dp_replicate").get_group(), iteration)
