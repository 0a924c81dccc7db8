"""Collectives under the name each supported torch gives them.

torch 2.13 names the functional all-gathers all_gather_single and all_gather_single_autograd, and
c10d's into-a-tensor all-gather and reduce-scatter all_gather_single and reduce_scatter_single;
it deprecates the older names (all_gather_tensor, all_gather_tensor_autograd,
all_gather_into_tensor, reduce_scatter_tensor), with a warning on every call. torch 2.11 has
only the older names.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
"""An all-gather along a dim, with no gradient."""

all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
"""An all-gather along a dim whose backward reduce-scatters."""

all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""c10d's all-gather into one output tensor (async_op as any c10d collective)."""

reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""c10d's reduce-scatter of one input tensor into one output tensor."""
