"""The vocabulary-parallel word embedding (dtgpt/parallel/vocab_parallel.py).

On PyTorch's fake process group (one process plays one tp rank; its collectives return no real
values): backward, which communicates nothing, gives each rank its rows of the one-device
gradient, shaped as its shard, and nothing from the ids of other ranks' rows. The forward's sum
over tp is checked on real ranks by the parity tests (tests/test_parity.py: tp2, tp2 + SP, tp4,
the untied Llama-style model), against one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtgpt
from dtgpt.config import padded_vocabulary
from dtgpt.model import GPT
from dtgpt.parallel import ParallelDims, build_model_parts
from dtgpt.parallel.vocab_parallel import VocabParallelEmbedding

VOCAB, HIDDEN, TP = 12, 4, 2


@pytest.fixture
def fake_rank(request):
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=TP)
    yield request.param
    dist.destroy_process_group()


@pytest.mark.parametrize("fake_rank", range(TP), indirect=True)
def test_each_ranks_gradient_is_its_rows_of_the_whole_one(fake_rank):
    torch.manual_seed(0)
    whole = torch.nn.Embedding(VOCAB, HIDDEN)
    sharded = torch.nn.Embedding(VOCAB, HIDDEN)
    sharded.load_state_dict(whole.state_dict())
    parallelize_module(sharded, init_device_mesh("cpu", (TP,)), VocabParallelEmbedding())
    ids = torch.tensor([[0, 5, 6, 11, 3], [7, 7, 1, 10, 6]])  # both halves, repeats
    grad = torch.randn(2, 5, HIDDEN)
    rows = VOCAB // TP
    first = fake_rank * rows

    out = sharded(ids)
    out.backward(grad)
    whole(ids).backward(grad)

    assert not isinstance(out, DTensor) and out.shape == (2, 5, HIDDEN)
    weight = sharded.weight
    assert weight.grad.placements == (Shard(0),) and weight.grad.to_local().shape == (rows, HIDDEN)
    torch.testing.assert_close(weight.grad.to_local(), whole.weight.grad[first : first + rows], rtol=0, atol=0)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_gradient_under_tp2_is_its_parameters_shard(sequence_parallel):
    """An untied GPT on tp2: every parameter's gradient has its shard's shape, the word
    embedding's (vocab/tp, hidden) included (DTensor's stock rowwise embedding gave it the whole
    vocabulary on every rank)."""
    cfg = dtgpt.make_config(
        model=dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, hidden_dropout=0.0, attention_dropout=0.0,
                   untie_embeddings_and_output_weights=True),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=1000, num_workers=0),
        training=dict(micro_batch_size=2, global_batch_size=2, train_iters=1),
        parallel=dict(tensor_model_parallel_size=TP, sequence_parallel=sequence_parallel),
    )  # fmt: skip
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        dims = ParallelDims.from_config(cfg, TP)
        dims.build_mesh("cpu")
        vocab = padded_vocabulary(cfg, 1000)
        with torch.device("meta"):
            whole = GPT(cfg.model, vocab)
        model = build_model_parts(cfg, dims, whole, torch.device("cpu")).parts[0]
        model(torch.randint(0, vocab, (2, 8))).sum().backward()
        word = model.embedding.word.weight
        assert word.to_local().shape == (vocab // TP, 16) and word.grad.to_local().shape == (vocab // TP, 16)
        for name, param in model.named_parameters():
            assert param.grad.to_local().shape == param.to_local().shape, name
    finally:
        dist.destroy_process_group()
