"""Initialisation by region (dtgpt.inits.fill_normal): a rank draws its shard of a parameter a
chunk at a time, and gets exactly the values of the one full draw (named_normal)."""

from __future__ import annotations

import random

import pytest
import torch

from dtgpt.inits import fill_normal, named_normal


def chunked_draw(n: int, block: int, seed: int = 5) -> torch.Tensor:
    """normal_ in draws of `block` (a multiple of 16) and a last one of at least 16."""
    generator, out, done = torch.Generator().manual_seed(seed), [], 0
    while done < n:
        take = n - done if n - done < block + 16 else block
        out.append(torch.empty(take).normal_(0.0, 0.02, generator=generator))
        done += take
    return torch.cat(out)


@pytest.mark.parametrize("n", [16, 17, 31, 32, 47, 100, 255, 1000, 4097])
@pytest.mark.parametrize("block", [16, 48, 256])
def test_cpu_normal_drawn_in_aligned_pieces_equals_one_draw(n, block):
    """The property fill_normal rests on (torch's CPU normal_ transforms 16 uniforms at a time,
    above and below its vectorised sizes): if torch changes it, this fails first."""
    whole = torch.empty(n).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(5))
    assert torch.equal(chunked_draw(n, block), whole)


@pytest.mark.parametrize("shape", [(1000, 64), (37,), (5000,), (3, 40, 50), (4, 48, 16), (7, 9, 11, 13)])
@pytest.mark.parametrize("chunk", [48, 1024, 1 << 16])
def test_any_region_is_the_full_draws_region(shape, chunk):
    full = named_normal("layers.0.w", shape, 0.02, 3, torch.device("cpu"))
    rng = random.Random(hash((shape, chunk)) & 0xFFFF)
    for _ in range(4):
        offsets = [rng.randrange(d) for d in shape]
        sizes = [rng.randint(1, d - o) for d, o in zip(shape, offsets)]
        out = torch.empty(sizes)
        fill_normal(out, "layers.0.w", shape, offsets, 0.02, 3, chunk=chunk)
        assert torch.equal(out, full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]), (offsets, sizes)

