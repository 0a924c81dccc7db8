"""A counter-based hash for random draws that are a function of what they decide, not of which
rank draws them: layout-invariant dropout (dtgpt/parallel/invariant_dropout.py) and the MoE
router's forced balance (dtgpt/moe/forced_balance.py).

MurmurHash3_x86_32 of 32-bit words, on int64 tensors that hold 32-bit values with products kept
below 2^63 (no overflow: the same bits on every device, eager or compiled). Plain PyTorch.
"""

from __future__ import annotations

import zlib

import torch

_LOW32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), in two 16-bit halves of c so nothing passes 2^63."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _LOW32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _LOW32


def _absorb(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """murmur3's step for one 32-bit word (broadcasting h against word)."""
    k = _mul32(_rotl32(_mul32(word & _LOW32, 0xCC9E2D51), 15), 0x1B873593)
    return (_rotl32(h ^ k, 13) * 5 + 0xE6546B64) & _LOW32


def murmur3_32(words: list[torch.Tensor | int], seed: int = 0) -> torch.Tensor:
    """MurmurHash3_x86_32 of the 32-bit words (int64 tensors holding values < 2^32, or ints),
    read as little-endian bytes, broadcast against one another: one hash per element.

    Put coarse words first: each step hashes at the broadcast shape of the words so far, so a
    per-token word is mixed once per token, not once per element of the mask.
    """
    device = next((w.device for w in words if isinstance(w, torch.Tensor)), None)
    h = torch.tensor(seed & _LOW32, dtype=torch.int64, device=device)
    for word in words:
        h = _absorb(h, word if isinstance(word, torch.Tensor) else torch.tensor(word, dtype=torch.int64, device=device))
    h = h ^ (4 * len(words))
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def token_hash(seed: int, site: str, token_index: torch.Tensor, *coordinates: torch.Tensor | int) -> torch.Tensor:
    """One 32-bit hash (int64 in [0, 2^32)) per element of the broadcast of token_index (int64,
    any value >= 0) and the coordinates (int64, < 2^32), keyed on the seed and the site's name."""
    words = [seed & _LOW32, (seed >> 32) & _LOW32, zlib.crc32(site.encode()), token_index, token_index >> 32, *coordinates]
    return murmur3_32(words)
