"""The one door to torch's variable-length attention kernel, `torch.nn.attention.varlen.varlen_attn`.

Flash attention over packed sequences: queries (Nq, heads, d) and keys/values (Nk, groups, d),
sequence i being queries cu_q[i]:cu_q[i+1] against keys cu_k[i]:cu_k[i+1]; causal masking is
aligned bottom-right (the last query sees the last key), so a query segment that ends where its
keys end attends exactly to the keys at or before its own position. No dropout, CUDA only (on
CPU torch raises NotImplementedError for `_flash_attention_forward`), fp16/bf16 only.

The API is new and has moved: it took `is_causal` (torch 2.10), then `window_size=(-1, 0)` for
causal (torch 2.13, installed here, and the main-branch source read for this); 2.13 has
`enable_gqa` (a version without it takes fewer key/value heads than query heads as they come:
flash does) and `scale` (without it q is scaled instead). torch 2.11, which the GPU machines run,
was not installed here: the keywords are read from the signature, so each of these forms works
(tests/test_attention_varlen.py checks the three on stand-ins), and the `cuda` test there is what
shows the real kernel right. CHECKED_TORCH lists the versions seen; the test that reads it fails
when torch moves outside them. Flash wants one head dim, a multiple of 8, for q, k and v: `causal_varlen` pads
(MLA's value head dim differs from its query's) and passes the softmax scale of the unpadded dim.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.nn.functional as F

CHECKED_TORCH = ("2.11", "2.12", "2.13")
"""Where the signature forms above were seen or are expected (2.11, 2.12: by the gpu check)."""

Kernel = Callable[..., torch.Tensor]
"""kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=, window=None) -> (Nq, heads, d): causal,
bottom-right; a window w: each query sees only the keys at most w before it (sliding-window
attention, flash's window_size=(w, 0)). `kernel.takes_window` says whether it can."""


@functools.cache
def _torch_kernel() -> Kernel | None:
    """torch's varlen_attn as a causal Kernel, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    windowed = "window_size" in params
    if not windowed and "is_causal" not in params:
        return None
    gqa, scaled = "enable_gqa" in params, "scale" in params

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):
        causal = {"window_size": (-1 if window is None else window, 0)} if windowed else {"is_causal": True}
        extra = {"enable_gqa": k.shape[1] != q.shape[1]} if gqa else {}
        if scaled:
            extra["scale"] = scale
        else:  # the kernel divides by sqrt(d): scaling q instead gives the same scores
            q = q * (scale * q.shape[-1] ** 0.5)
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **causal, **extra)

    kernel.takes_window = windowed
    return kernel


def kernel_for(q: torch.Tensor) -> Kernel | None:
    """The kernel that runs attention on q's device and dtype, or None: the caller keeps its
    masked SDPA (CPU, fp32, a GPU without flash attention, a torch without varlen_attn).
    Callers look it up through this module, so a test can stand a CPU reference in for it."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    # Flash attention needs Ampere or later; from Blackwell (10.x) some torch versions route
    # varlen_attn to cuDNN, whose causal alignment was not checked here: the masked path there.
    if _major_capability(q.device.index) not in (8, 9):
        return None
    return _torch_kernel()


def windowed_kernel_for(q: torch.Tensor, window: int | None) -> Kernel | None:
    """kernel_for(q), where window is set only a kernel that takes it (torch's varlen_attn with
    window_size); else None: the masked path runs (on CUDA, with its dense mask)."""
    kernel = kernel_for(q)
    return kernel if window is None or getattr(kernel, "takes_window", False) else None


@functools.cache
def _major_capability(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _pad_to(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def causal_varlen(
    kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    window: int | None = None,
) -> torch.Tensor:
    """Packed q (Nq, nh, d), k (Nk, ng, d), v (Nk, ng, dv) -> (Nq, nh, dv), scaled by d ** -0.5 as SDPA."""
    d, dv = q.shape[-1], v.shape[-1]
    padded = -(-max(d, dv) // 8) * 8
    windowed = {"window": window} if window is not None else {}  # a stand-in kernel without the keyword still runs
    out = kernel(_pad_to(q, padded), _pad_to(k, padded), _pad_to(v, padded), cu_q, cu_k, max_q, max_k, scale=d**-0.5, **windowed)
    return out[..., :dv]
