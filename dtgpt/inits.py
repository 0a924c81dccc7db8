"""The initialisations a module may declare for its parameters (`declared_inits()`): the
vocabulary dtgpt.model's init_weights reads, shared with the MoE modules (dtgpt/moe)."""

from __future__ import annotations

import enum
import itertools
import math
import zlib

import torch
import torch.nn as nn


class Init(enum.Enum):
    """The initialisations a module may declare for its parameters (Megatron's GPT init)."""

    NORMAL = "normal"
    """N(0, init_method_std): Megatron's init_method."""
    SCALED_NORMAL = "scaled_normal"
    """N(0, init_method_std / sqrt(2 * num_layers)): Megatron's output_layer_init_method, for the
    projections that write into the residual stream."""
    ZEROS = "zeros"
    ONES = "ones"


DeclaredInits = list[tuple[nn.Parameter, Init]]


def linear_inits(linear: nn.Linear, weight: Init) -> DeclaredInits:
    """A linear layer's weight gets `weight`; its bias, if any, starts at zero."""
    inits = [(linear.weight, weight)]
    if linear.bias is not None:
        inits.append((linear.bias, Init.ZEROS))
    return inits


def named_normal(name: str, shape, std: float, seed: int, device: torch.device) -> torch.Tensor:
    """N(0, std) of `shape`, drawn from a generator seeded by (seed, name) alone: a parameter's
    initial value never depends on which other parameters a rank holds or the order of the draws."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


WORK_CHUNK = 1 << 16
"""Elements drawn at a time by fill_normal: its working memory whatever the parameter's size."""
_BLOCK_ALIGN = 16
"""torch's CPU normal_ turns its uniforms into normals 16 at a time and redraws the last 16 of a
size not a multiple of 16: draws of multiples of 16, then one of at least 16 that ends the
tensor, consume the generator as one whole draw does and give the same values (test_inits.py)."""


class _NormalStream:
    """The values of one `normal_` draw of `total` elements, produced WORK_CHUNK at a time."""

    def __init__(self, generator: torch.Generator, total: int, std: float, device: torch.device, chunk: int):
        self.generator, self.left, self.std, self.device = generator, total, std, device
        self.chunk = max(_BLOCK_ALIGN, chunk - chunk % _BLOCK_ALIGN)
        self.buffer, self.pos = torch.empty(0, device=device), 0

    def _refill(self) -> None:
        size = self.left if self.left < self.chunk + _BLOCK_ALIGN else self.chunk
        self.buffer = torch.empty(size, device=self.device).normal_(0.0, self.std, generator=self.generator)
        self.pos, self.left = 0, self.left - size

    def take(self, n: int, keep: bool = True) -> torch.Tensor | None:
        """The next n values (n <= chunk), or None when not `keep` (drawn and dropped)."""
        parts = []
        while n:
            if self.pos == self.buffer.numel():
                self._refill()
            k = min(n, self.buffer.numel() - self.pos)
            if keep:
                parts.append(self.buffer[self.pos : self.pos + k])
            self.pos, n = self.pos + k, n - k
        if not keep:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def fill_normal(
    out: torch.Tensor, name: str, shape, offsets, std: float, seed: int, chunk: int = WORK_CHUNK
) -> None:
    """Write into `out` its region (at `offsets`, of out's shape) of named_normal(name, shape, std,
    seed), without creating the full tensor: the full draw is replayed a chunk at a time, up to
    the region's last element, so a shard costs one chunk of memory and every layout gets the
    values of the one full draw (bitwise on CPU; on CUDA, whose generator draws per call, the
    same values in every layout)."""
    shape, offsets, sizes = tuple(shape), tuple(offsets), tuple(out.shape)
    total = math.prod(shape)
    if total <= chunk:  # small: the plain draw
        full = named_normal(name, shape, std, seed, out.device)
        out.copy_(full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])
        return
    if out.numel() == 0:
        return
    generator = torch.Generator(device=out.device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    stream = _NormalStream(generator, total, std, out.device, chunk)
    # Split the dims: the trailing ones (`inner`, at most a chunk) are taken whole, dim k - 1 in
    # groups of rows, the leading ones one index at a time.
    k = next(k for k in range(1, len(shape) + 1) if math.prod(shape[k:]) <= chunk)
    inner = math.prod(shape[k:])
    rows = max(1, chunk // inner)
    inner_box = tuple(slice(o, o + s) for o, s in zip(offsets[k:], sizes[k:]))
    lo, hi = offsets[k - 1], offsets[k - 1] + sizes[k - 1]
    prefixes = itertools.product(*(range(d) for d in shape[: k - 1]))
    last = tuple(o + s - 1 for o, s in zip(offsets[: k - 1], sizes[: k - 1]))
    for prefix in prefixes:
        inside = all(o <= i < o + s for i, o, s in zip(prefix, offsets, sizes))
        for r0 in range(0, shape[k - 1], rows):
            r1 = min(r0 + rows, shape[k - 1])
            if not inside or r1 <= lo or r0 >= hi:
                if inside and r0 >= hi and prefix == last:
                    return  # past the region's last element: the rest of the draw is not needed
                stream.take((r1 - r0) * inner, keep=False)
                continue
            values = stream.take((r1 - r0) * inner).view(r1 - r0, *shape[k:])
            a, b = max(r0, lo), min(r1, hi)
            target = out[tuple(i - o for i, o in zip(prefix, offsets))] if prefix else out
            target[a - lo : b - lo].copy_(values[a - r0 : b - r0][(slice(None), *inner_box)])
