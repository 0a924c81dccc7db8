"""Context parallelism's pieces on one process: the sequence split, the global-index mask, positions.

The collective itself is replaced by its result (every rank's keys in cp-rank order), so these
check the arithmetic; tests/test_parity.py checks the whole on real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from dtgpt.config import load_config
from dtgpt.model import GPT, CoreAttention
from dtgpt.rope import apply_rotary, rotary_frequencies
from dtgpt.mtp import shift_left
from dtgpt.parallel.context import ContextParallelAttention, WholeRows, global_indices, split_sequence
from dtgpt.parallel.context_shift import ContextParallelShift, next_chunk_holder


def test_split_sequence_keeps_chunks_r_and_its_mirror():
    seq = torch.arange(16).view(1, 16)  # 2 * cp = 8 chunks of 2 tokens
    parts = [split_sequence(seq, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]]
    assert parts[3].tolist() == [[6, 7, 8, 9]]
    assert sorted(torch.cat(parts, dim=1).flatten().tolist()) == list(range(16))  # a partition
    assert torch.equal(split_sequence(seq, 0, 1), seq)
    assert global_indices(4, 1, 4, torch.device("cpu")).tolist() == [2, 3, 12, 13]


class GatheredByHand(ContextParallelAttention):
    """The cp core of rank `cp_rank` whose all-gathers return the given tensors, in call order
    (the keys, the values, then the document ids)."""

    def __init__(self, cp_rank: int, cp_size: int, gathered: list[torch.Tensor], window: int | None = None):
        torch.nn.Module.__init__(self)
        self.cp_rank, self.cp_size, self.gathered, self.window = cp_rank, cp_size, list(gathered), window
        self.whole_rows = WholeRows()

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self.gathered.pop(0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("with_documents", [False, True])
@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window3"])
@pytest.mark.parametrize("sink", [None, (-1.0, 0.0, 2.0)], ids=["no_sink", "sink"])
def test_cp_attention_equals_full_sequence_attention(cp, with_documents, window, sink):
    """Each rank's output is its chunks of the one-process output (causal, and within documents;
    a sliding window counts back in global positions, across the chunks' bounds; a sink logit per head)."""
    torch.manual_seed(0)
    B, nh, T, hd = 2, 3, 16, 8
    q, k, v = (torch.randn(B, nh, T, hd) for _ in range(3))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if with_documents else None
    windowed = [f"--model.window_size={window},0"] if window else []
    core = CoreAttention(load_config(None, ["--data.mock_data=true", *windowed]).model).eval()
    sink = torch.tensor(sink) if sink else None
    expected = core(q, k, v, document_ids=docs, sink=sink)
    if with_documents and not window and sink is None:  # the one-process reference itself: a document attends to itself alone
        second = slice(5, 12)
        alone = core(q[:1, :, second], k[:1, :, second], v[:1, :, second])
        torch.testing.assert_close(expected[:1, :, second], alone)
        torch.testing.assert_close(expected[1:], core(q[1:], k[1:], v[1:]))

    def all_ranks(t: torch.Tensor, dim: int) -> torch.Tensor:  # what the all-gather returns
        return torch.cat([split_sequence(t, r, cp, dim) for r in range(cp)], dim)

    gathered = [all_ranks(k, 2), all_ranks(v, 2)] + ([all_ranks(docs, 1)] if with_documents else [])
    for r in range(cp):
        local = [split_sequence(t, r, cp, dim=2) for t in (q, k, v)]
        local_docs = split_sequence(docs, r, cp) if with_documents else None
        out = GatheredByHand(r, cp, gathered, core.window)(*local, document_ids=local_docs, sink=sink)
        torch.testing.assert_close(out, split_sequence(expected, r, cp, dim=2), rtol=1e-5, atol=1e-6)


def test_positions_reach_rope_and_the_learned_table():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 8)  # (B, T, nh, hd)
    positions = torch.arange(8).expand(2, 8)
    cfg = load_config(None, ["--data.mock_data=true", "--model.num_layers=1", "--model.hidden_size=16",
                             "--model.num_attention_heads=2", "--model.seq_length=8"])  # fmt: skip
    inv_freq = rotary_frequencies(cfg.model)
    assert torch.equal(apply_rotary(x, inv_freq, positions), apply_rotary(x, inv_freq))
    cut = split_sequence(positions, 1, 2)
    assert torch.allclose(apply_rotary(split_sequence(x, 1, 2), inv_freq, cut), split_sequence(apply_rotary(x, inv_freq), 1, 2))
    model = GPT(cfg.model, 64).eval()
    model.init_weights(0)
    tokens = torch.randint(0, 64, (2, 8))
    embedded = model.embedding(tokens)
    assert torch.equal(model.embedding(split_sequence(tokens, 1, 2), cut), split_sequence(embedded, 1, 2))


class HeadsByHand(ContextParallelShift):
    """The cp shift of rank `cp_rank` whose all-gather returns every rank's chunk heads of `full`."""

    def __init__(self, cp_rank: int, cp_size: int, full: torch.Tensor):
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.heads = [split_sequence(full, r, cp_size, dim=-1).chunk(2, dim=-1) for r in range(cp_size)]

    def gather(self, heads: torch.Tensor) -> torch.Tensor:
        return torch.stack([chunk[..., 0] for parts in self.heads for chunk in parts])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_shift_is_the_full_sequence_shift_cut(cp):
    """Multi-token prediction's shift on each rank's chunks is its chunks of the one-process shift."""
    full = torch.randint(0, 1000, (2, 2 * cp * 3))
    expected = shift_left(full, -100)
    for r in range(cp):
        local = split_sequence(full, r, cp, dim=-1)
        shifted = HeadsByHand(r, cp, full)(local, -100)
        assert torch.equal(shifted, split_sequence(expected, r, cp, dim=-1)), r
    assert next_chunk_holder(2 * cp - 1, cp) is None and next_chunk_holder(cp - 1, cp) == (cp - 1, 1)


def test_cp_shift_gathers_without_a_deprecation_warning():
    """The heads' all-gather is torch's current one (torch 2.13 warns on all_gather_tensor every
    micro-batch of a multi-token prediction run under cp); one rank's group suffices to call it."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shift = ContextParallelShift(init_device_mesh("cpu", (1,)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            heads = torch.arange(6).view(2, 3)
            assert torch.equal(shift.gather(heads), heads)
    finally:
        dist.destroy_process_group()
