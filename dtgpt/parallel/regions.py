"""Where a rank's part of a (maybe sharded) tensor lies in the full tensor.

The one door to torch's private `compute_local_shape_and_global_offset` (torch 2.11-2.13): DCP's
own planner asks a DTensor the same, and no public API gives the offsets. Initialisation
(dtgpt.inits.fill_draw) and the Megatron import (dtgpt/checkpoint/megatron/load.py) use it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_region(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local sizes) of this rank's part of a parameter or optimizer tensor."""
    if isinstance(value, DTensor):
        sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return tuple(offsets), tuple(sizes)
    return (0,) * value.dim(), tuple(value.shape)


def local_part(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the tensor this rank holds of `value`, its global offsets): what an initialisation writes."""
    offsets, _ = local_region(value)
    return (value.to_local() if isinstance(value, DTensor) else value), offsets
