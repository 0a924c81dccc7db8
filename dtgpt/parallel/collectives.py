"""The functional all-gathers under the name each supported torch gives them.

torch 2.13 names them all_gather_single and all_gather_single_autograd and deprecates the older
all_gather_tensor and all_gather_tensor_autograd, with a warning on every call; torch 2.11 has
only the older names.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol

all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
"""An all-gather along a dim, with no gradient."""

all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
"""An all-gather along a dim whose backward reduce-scatters."""
