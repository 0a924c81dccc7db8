"""The initialisations a module may declare for its parameters (`declared_inits()`): the
vocabulary dtgpt.model's init_weights reads, shared with the MoE modules (dtgpt/moe)."""

from __future__ import annotations

import enum
import itertools
import math
import zlib
from typing import NamedTuple

import torch
import torch.nn as nn

from dtgpt.config import ModelConfig


class Init(enum.Enum):
    """The initialisations a module may declare for its parameters (Megatron's GPT init)."""

    NORMAL = "normal"
    """N(0, init_method_std): Megatron's init_method."""
    EMBEDDING = "embedding"
    """Megatron's embedding_init_method (word and position embeddings, and a tied output layer):
    N(0, embedding_init_method_std), which defaults to init_method_std (initial_draw)."""
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


class Draw(NamedTuple):
    """A random initialisation: N(0, scale) or, `uniform`, U(-scale, scale) (xavier_uniform's)."""

    scale: float
    uniform: bool = False

    def sample(self, size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        out = torch.empty(size, device=device)
        if self.uniform:
            return out.uniform_(-self.scale, self.scale, generator=generator)
        return out.normal_(0.0, self.scale, generator=generator)

    @property
    def align(self) -> int:
        """torch's CPU normal_ turns its uniforms into normals 16 at a time and redraws the last 16
        of a size not a multiple of 16: draws of multiples of 16, then one of at least 16 that ends
        the tensor, consume the generator as one whole draw does and give the same values. uniform_
        draws element by element: any split does (test_inits.py checks both)."""
        return 1 if self.uniform else 16


def xavier_bound(fan_in: int, fan_out: int) -> float:
    """torch.nn.init.xavier_uniform_'s bound (gain 1): U(-a, a), a = sqrt(6 / (fan_in + fan_out))."""
    return math.sqrt(6.0 / (fan_in + fan_out))


def initial_draw(cfg: ModelConfig, kind: Init, fans: tuple[int, int]) -> Draw:
    """Megatron's draw for a weight of `kind` with (fan_in, fan_out) `fans`, as its
    TransformerConfig resolves init_method, output_layer_init_method and embedding_init_method:
    under init_method_xavier_uniform the first two are xavier_uniform; the embeddings are
    N(0, embedding_init_method_std) where that std differs from init_method_std (or no init_method
    was given), else init_method's draw."""
    embedding_std = cfg.init_method_std if cfg.embedding_init_method_std is None else cfg.embedding_init_method_std
    if cfg.init_method_xavier_uniform and (kind is not Init.EMBEDDING or embedding_std == cfg.init_method_std):
        return Draw(xavier_bound(*fans), uniform=True)
    if kind is Init.EMBEDDING:
        return Draw(embedding_std)
    if kind is Init.SCALED_NORMAL:
        return Draw(cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers))
    return Draw(cfg.init_method_std)


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    """A generator seeded by (seed, name) alone: a parameter's initial value never depends on
    which other parameters a rank holds or the order of the draws."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return generator


def named_draw(name: str, shape, draw: Draw, seed: int, device: torch.device) -> torch.Tensor:
    """`draw` of `shape` from the generator of (seed, name)."""
    return draw.sample(shape, _generator(name, seed, device), device)


def named_normal(name: str, shape, std: float, seed: int, device: torch.device) -> torch.Tensor:
    """N(0, std) of `shape` from the generator of (seed, name)."""
    return named_draw(name, shape, Draw(std), seed, device)


WORK_CHUNK = 1 << 16
"""Elements drawn at a time by fill_draw: its working memory whatever the parameter's size."""


class _DrawStream:
    """The values of one draw of `total` elements, produced WORK_CHUNK at a time."""

    def __init__(self, generator: torch.Generator, total: int, draw: Draw, device: torch.device, chunk: int):
        self.generator, self.left, self.draw, self.device = generator, total, draw, device
        self.chunk = max(draw.align, chunk - chunk % draw.align)
        self.buffer, self.pos = torch.empty(0, device=device), 0

    def _refill(self) -> None:
        size = self.left if self.left < self.chunk + self.draw.align else self.chunk
        self.buffer = self.draw.sample(size, self.generator, self.device)
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


def fill_draw(out: torch.Tensor, name: str, shape, offsets, draw: Draw, seed: int, chunk: int = WORK_CHUNK) -> None:
    """Write into `out` its region (at `offsets`, of out's shape) of named_draw(name, shape, draw,
    seed), without creating the full tensor: the full draw is replayed a chunk at a time, up to
    the region's last element, so a shard costs one chunk of memory and every layout gets the
    values of the one full draw (bitwise on CPU; on CUDA, whose generator draws per call, the
    same values in every layout)."""
    shape, offsets, sizes = tuple(shape), tuple(offsets), tuple(out.shape)
    total = math.prod(shape)
    if total <= chunk:  # small: the plain draw
        full = named_draw(name, shape, draw, seed, out.device)
        out.copy_(full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])
        return
    if out.numel() == 0:
        return
    stream = _DrawStream(_generator(name, seed, out.device), total, draw, out.device, chunk)
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
