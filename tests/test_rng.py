"""Megatron's dropout RNG under tensor parallelism (dtgpt/parallel/rng.py), on 2 real gloo ranks,
and the layout-invariant one (dtgpt/parallel/invariant_dropout.py) in one process.

Megatron's: in tensor-parallel regions (attention dropout on each rank's heads, hidden dropout on
a sequence-parallel chunk) the tp ranks must draw independent masks; in replicated regions (the
embedding's dropout, hidden dropout without sequence parallelism) the same mask. Both streams
must survive a checkpoint.

Layout-invariant: each mask element is MurmurHash3 of its words (checked against the published
algorithm), drops with probability p independently of other sites and elements, and a rank's
slice of a mask is that slice of one process's mask; tests/test_parity.py trains with it on four
layouts against one process.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
import torch.utils.checkpoint

from dtgpt.config import ModelConfig
from dtgpt.model import CoreAttention
from dtgpt.parallel.invariant_dropout import InvariantAttention, InvariantDropout, dropped_attention, keep_mask
from dtgpt.parallel.rng import ModelParallelRNG, model_parallel_seed, stage_seed
from tests.runs import run_worker

INDEPENDENT = 0.05
"""|correlation| bound for independent masks: each holds >= 16k Bernoulli(0.5) draws, so the
sample correlation of independent ones has a standard deviation below 1/sqrt(16k) ~ 0.008; the
draws are seeded, so the value is fixed (no flakiness), and a shared stream would give 1."""


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.flatten().float(), b.flatten().float()]))[0, 1].item()


@pytest.fixture(scope="module")
def masks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rng")
    run_worker("rng_worker.py", 2, out)
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def tp_region(sp: bool, name: str) -> bool:
    return name.endswith("core") or (sp and name.startswith("layers.") and name.endswith("dropout"))


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_tp_regions_draw_independent_masks_replicated_regions_equal_ones(masks, sp):
    rank0, rank1 = (m[f"sp{int(sp)}"]["draw 1"] for m in masks)
    blocks = {f"layers.{i}.{m}" for i in (0, 1) for m in ("dropout", "mlp_dropout", "attention.core")}
    assert set(rank0) == {"embedding.dropout", *blocks}
    for name in rank0:
        a, b = rank0[name], rank1[name]
        assert 0.4 < a.float().mean() < 0.6, name  # dropout 0.5 did drop
        if tp_region(sp, name):
            assert abs(correlation(a, b)) < INDEPENDENT, name
        else:
            assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_both_streams_survive_save_and_load(masks, sp):
    for rank in masks:
        drawn = rank[f"sp{int(sp)}"]
        for name in drawn["draw 2"]:
            assert torch.equal(drawn["after load"][name], drawn["draw 2"][name]), name
            assert not torch.equal(drawn["draw 1"][name], drawn["draw 2"][name]), name  # the streams move on


def test_seeds_are_megatrons():
    assert stage_seed(1234, pp_rank=2) == 1234 + 200
    assert model_parallel_seed(1234, pp_rank=2, tp_rank=3) == 1234 + 200 + 2718 + 3
    # a re-derived seed (another mesh) moves with the iteration
    assert stage_seed(1234, 0, iteration=7) != stage_seed(1234, 0, iteration=8)


def test_fork_leaves_the_default_stream_alone():
    rng = ModelParallelRNG(torch.device("cpu"), seed=5)
    torch.manual_seed(0)
    with rng.fork():
        forked = torch.rand(4)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))  # as if the fork had not happened
    assert torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(5)))
    with rng.fork():
        assert not torch.equal(torch.rand(4), forked)  # the forked stream continues


def test_recomputation_replays_the_model_parallel_stream():
    """A recomputed tp-region dropout must redraw the forward's mask, or gradients are wrong."""
    rng = ModelParallelRNG(torch.device("cpu"), seed=5)
    x = torch.randn(1000, requires_grad=True)

    def tp_dropout(x):
        with rng.fork():
            return torch.nn.functional.dropout(x * 1.0, 0.5)

    y = torch.utils.checkpoint.checkpoint(tp_dropout, x, use_reentrant=False, context_fn=rng.recompute_contexts)
    after_forward = rng.state.clone()
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() * 2.0)
    assert torch.equal(rng.state, after_forward)  # the recomputation leaves the stream where forward did


# -- layout-invariant dropout (model.dropout_rng='layout_invariant') ----------------------------


def murmur3_reference(data: bytes, seed: int) -> int:
    """MurmurHash3_x86_32 as published (Appleby's reference), on Python ints: the oracle."""
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & mask  # noqa: E731
    h, whole = seed & mask, len(data) // 4 * 4
    for i in range(0, whole, 4):
        k = rotl(int.from_bytes(data[i : i + 4], "little") * c1 & mask, 15) * c2 & mask
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & mask
    if len(data) > whole:
        k = rotl(int.from_bytes(data[whole:], "little") * c1 & mask, 15) * c2 & mask
        h ^= k
    h ^= len(data)
    h = (h ^ (h >> 16)) * 0x85EBCA6B & mask
    h = (h ^ (h >> 13)) * 0xC2B2AE35 & mask
    return h ^ (h >> 16)


def test_reference_murmur3_matches_published_vectors():
    # Widely published test vectors of MurmurHash3_x86_32 (data, seed, hash).
    vectors = [
        (b"", 0, 0), (b"", 1, 0x514E28B7), (b"", 0xFFFFFFFF, 0x81F16F39), (b"\0\0\0\0", 0, 0x2362F9DE),
        (b"\x21\x43\x65\x87", 0, 0xF55B516B), (b"\xff\xff\xff\xff", 0, 0x76293B50), (b"aaaa", 0x9747B28C, 0x5A97808A),
        (b"Hello, world!", 0x9747B28C, 0x24884CBA), (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
    ]  # fmt: skip
    for data, seed, expected in vectors:
        assert murmur3_reference(data, seed) == expected, data


def test_keep_mask_is_murmur3_of_seed_site_token_and_coordinates():
    """Every element of a mask is the hash of its own words, token indices past 2^32 included."""
    seed, site, p = 1234, "layers.3.mlp_dropout", 0.3
    tokens = torch.tensor([[0, 31], [2**33 + 5, 7 * 2**32 - 1]])[..., None]  # (2, 2, 1)
    hidden = torch.arange(3)
    keep = keep_mask(p, seed, site, tokens, hidden)
    assert keep.shape == (2, 2, 3)
    for (b, t, c), kept in zip(itertools.product(range(2), range(2), range(3)), keep.flatten().tolist()):
        token = tokens[b, t, 0].item()
        words = [seed, 0, zlib.crc32(site.encode()), token & 0xFFFFFFFF, token >> 32, c]
        data = b"".join(w.to_bytes(4, "little") for w in words)
        assert kept == (murmur3_reference(data, 0) >= round(p * 2**32)), (b, t, c)


def test_invariant_masks_drop_p_independently_per_site():
    tokens = torch.arange(256)[:, None]
    hidden = torch.arange(128)
    a = keep_mask(0.5, 1234, "layers.0.dropout", tokens, hidden)
    b = keep_mask(0.5, 1234, "layers.0.mlp_dropout", tokens, hidden)
    c = keep_mask(0.5, 1235, "layers.0.dropout", tokens, hidden)
    assert 0.48 < a.float().mean() < 0.52
    for other in (b, c, a.roll(1, dims=0), a.roll(1, dims=1)):  # another site, seed, token, hidden index
        assert abs(correlation(a, other)) < INDEPENDENT
    assert 0.08 < (~keep_mask(0.1, 1234, "x", tokens, hidden)).float().mean() < 0.12


def test_a_rank_draws_its_slice_of_the_whole_mask():
    """A sequence-parallel chunk of hidden dropout, and a tp rank's heads of attention dropout,
    are drawn as the same slices of what one process draws."""
    token_index = torch.arange(2 * 8).view(2, 8) + 40 * 8  # samples 40 and 41, seq_length 8
    x = torch.randn(2, 8, 16)
    whole = InvariantDropout(0.5, 7, "layers.1.dropout")(x, token_index)
    for rank in (0, 1):
        chunk = InvariantDropout(0.5, 7, "layers.1.dropout", chunk=rank, chunks=2)(x.chunk(2, dim=1)[rank], token_index)
        assert torch.equal(chunk, whole.chunk(2, dim=1)[rank])
    q, k, v = (torch.randn(2, 4, 8, 4) for _ in range(3))
    core = CoreAttention(ModelConfig(attention_dropout=0.5))
    whole = InvariantAttention(0.5, 7, "layers.1.attention.core", 0, core)(q, k, v, token_index=token_index)
    for rank in (0, 1):
        heads = slice(2 * rank, 2 * rank + 2)
        rank_core = InvariantAttention(0.5, 7, "layers.1.attention.core", 2 * rank, core)
        got = rank_core(q[:, heads], k[:, heads], v[:, heads], token_index=token_index)
        torch.testing.assert_close(got, whole[:, heads], rtol=0, atol=1e-6)
    # What it computes with nothing dropped: scaled_dot_product_attention's causal attention.
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(dropped_attention(q, k, v, causal, torch.ones_like(causal), p=0.0), sdpa)


def test_recomputation_redraws_the_invariant_mask():
    dropout = InvariantDropout(0.5, 5, "layers.0.dropout")
    x = torch.randn(4, 8, 32, requires_grad=True)
    token_index = torch.arange(32).view(4, 8)
    y = torch.utils.checkpoint.checkpoint(dropout, x, token_index, use_reentrant=False)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() * 2.0)
