"""Which device a rank trains on: a pure function of the request and the machine's GPU count.

`training.device = "auto"` means CUDA only where every local rank has a GPU of its own; a mesh
with more local ranks than GPUs is refused rather than sharing a GPU (NCCL cannot run two ranks
on one device) or silently falling back to CPU. The fix is named in the error: the same mesh
runs on CPU with gloo under `--training.device=cpu` (how to debug an 8-rank mesh on a one-GPU
workstation).
"""

from __future__ import annotations

from dtgpt.config.sections import ConfigError

CPU_FIX = "--training.device=cpu runs the same mesh on CPU (gloo)"


def choose_device(requested: str, local_ranks: int, gpus: int) -> str:
    """'cpu' or 'cuda' for `training.device=requested` with `local_ranks` ranks on this node and
    `gpus` visible CUDA devices; ConfigError (one line naming both counts and the fix) where CUDA
    is asked for, or found, but cannot give each local rank a GPU of its own."""
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return "cpu"
    ranks = f"{local_ranks} local rank{'s' if local_ranks != 1 else ''}"
    if gpus == 0:
        raise ConfigError(f"training.device={requested!r} but this machine has no CUDA device for its {ranks}: {CPU_FIX}")
    if local_ranks > gpus:
        raise ConfigError(
            f"training.device={requested!r}: {ranks} but {gpus} CUDA device{'s' if gpus != 1 else ''} "
            f"(each rank needs a GPU of its own): start at most {gpus} rank{'s' if gpus != 1 else ''} per node, "
            f"or {CPU_FIX}"
        )
    return "cuda"
