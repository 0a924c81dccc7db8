"""Megatron's per-rank import reads only the files that hold what a rank asks for: the files are
memory-mapped (torch.load(mmap=True)), the shapes come from the tensors' metadata without building
a stacked tensor, and a region opens only the tp ranks' files whose rows it overlaps."""

from __future__ import annotations

import pytest
import torch

import dtgpt
from dtgpt.checkpoint.megatron import per_rank, to_megatron_per_rank
from dtgpt.checkpoint.megatron.keys import full_model_shapes
from dtgpt.checkpoint.megatron.reader import MegatronReader

VOCAB = 128
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, untie_embeddings_and_output_weights=True)


def save_tiny(out, model: dict):
    """A freshly initialised dtgpt checkpoint of `model` (mock data, NullTokenizer of VOCAB) in
    `out`: (its iteration directory, its config)."""
    cfg = dtgpt.make_config(
        model=model, data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        training=dict(micro_batch_size=1, global_batch_size=1, train_iters=1),
    )  # fmt: skip
    runtime = dtgpt.init_distributed(cfg)
    built = dtgpt.build_model(cfg, runtime, vocab_size=VOCAB)
    saved = dtgpt.save_checkpoint(out, cfg, runtime, built)
    dtgpt.shutdown()
    return saved, cfg


@pytest.fixture(scope="module")
def tp2_files(tmp_path_factory):
    """A dtgpt checkpoint written as Megatron's per-rank files at tp 2 (mp_rank_00, mp_rank_01)."""
    root = tmp_path_factory.mktemp("per_rank")
    saved, cfg = save_tiny(root / "dtgpt", MODEL)
    return to_megatron_per_rank(saved, cfg, root / "megatron", tp=2), cfg


def opened_files(monkeypatch) -> list[str]:
    opened, load = [], per_rank.load_pickle

    def recording(path, *args, **kwargs):
        opened.append(path.parent.name)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(per_rank, "load_pickle", recording)
    return opened


def test_a_region_of_tp_rank_0_rows_opens_only_its_file(tp2_files, monkeypatch):
    directory, cfg = tp2_files
    opened = opened_files(monkeypatch)
    reader = MegatronReader(directory)
    full = full_model_shapes(cfg.model, reader.shapes["embedding.word_embeddings.weight"][0])
    reader.check(full, list(full))
    # Rows 0 .. half of every tensor (tp rank 0's rows of the column-parallel ones; the
    # row-parallel ones' columns come from both ranks: only their first row is asked for).
    row_parallel = ("attention.proj.weight", "mlp.fc2.weight")
    wanted = {}
    for name, shape in full.items():
        if name.endswith(row_parallel):
            sizes = (1, shape[1] // 2)
        else:
            sizes = (max(1, shape[0] // 2), *shape[1:])
        wanted[name] = (name, None, (0,) * len(shape), sizes)
    regions = reader.regions(wanted)
    assert opened == ["mp_rank_00"], opened
    # The same regions cut from the whole tensors (read from both files) are equal.
    for name, (_, _, offsets, sizes) in wanted.items():
        whole = reader.tensor(name, full[name])
        assert torch.equal(regions[name], whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]), name
    assert sorted(set(opened)) == ["mp_rank_00", "mp_rank_01"]


def test_shapes_build_no_stacked_tensor(tp2_files, monkeypatch):
    directory, _ = tp2_files
    monkeypatch.setattr(torch, "stack", lambda *a, **k: pytest.fail("a stacked tensor was built"))
    monkeypatch.setattr(torch, "cat", lambda *a, **k: pytest.fail("a joined tensor was built"))
    shapes = MegatronReader(directory).shapes
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (2, 96, 32)
    assert shapes["embedding.word_embeddings.weight"][1] == 32
