"""Megatron-LM per-rank checkpoints of an uneven pipeline split read back whole: files written
with decoder_first/last_pipeline_num_layers (to-megatron), and files whose first stage holds only
the embedding (account_for_embedding_in_pipeline_split, or a layout 'E|...'), their stages' layer
counts those megatron-core builds for the same flags."""

from __future__ import annotations

import pytest
import torch

from dtgpt.checkpoint import CheckpointError
from dtgpt.checkpoint.export import load_model
from dtgpt.checkpoint.megatron import find, load_megatron_model, to_megatron_per_rank
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, load_pickle, per_rank_dirs
from dtgpt.checkpoint.megatron.per_rank import PerRankModel
from tests.megatron_checkpoints import write_stages
from tests.test_megatron_per_rank_reads import save_tiny
from tests.test_pipeline_split import megatron_counts, megatron_ranks  # noqa: F401 (a fixture)

LAYERS = 6
MODEL = dict(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, seq_length=16, untie_embeddings_and_output_weights=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dtgpt checkpoint of a 6-layer model, and its config."""
    return save_tiny(tmp_path_factory.mktemp("uneven") / "dtgpt", MODEL)


def assert_reads_back(megatron_dir, directory, cfg) -> None:
    ours = load_model(directory, cfg).state_dict()
    theirs = load_megatron_model(find(megatron_dir), cfg.model, ours["embedding.word.weight"].shape[0]).state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name


def stage_layers(directory, pp: int) -> list[int]:
    """Decoder layers in each pp rank's file (tp rank 0)."""
    files = [load_pickle(find(directory) / f"mp_rank_00_{r:03d}" / PER_RANK_FILE)["model"] for r in range(pp)]
    return [sum(1 for k in f if k.startswith("decoder.layers.") and k.endswith(".self_attention.linear_proj.weight")) for f in files]


@pytest.mark.parametrize("pp, first, last", [(2, None, 1), (3, 1, 1), (4, 3, None)])
def test_uneven_per_rank_files_write_then_read_as_megatron_core_splits(saved, tmp_path, megatron_ranks, pp, first, last):  # noqa: F811
    directory, cfg = saved
    out = to_megatron_per_rank(directory, cfg, tmp_path / "m", pp=pp, first_stage_layers=first, last_stage_layers=last)
    args = load_pickle(out / "mp_rank_00_000" / PER_RANK_FILE)["args"]
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (first, last)
    fields = {k: v for k, v in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)) if v}
    assert stage_layers(tmp_path / "m", pp) == megatron_counts(megatron_ranks, LAYERS, pp, 1, fields)
    assert_reads_back(tmp_path / "m", directory, cfg)


def test_a_first_stage_of_only_the_embedding_reads_back(saved, tmp_path, megatron_ranks):  # noqa: F811
    """Megatron's --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split at
    pp 4 with 6 layers: stages of 1, 2, 2, 1; with vp 2 (8 stages of 1 layer, less the embedding's
    and the loss's): the first chunk holds only the embedding, the last only the head."""
    directory, cfg = saved
    to_megatron_per_rank(directory, cfg, tmp_path / "pp1", pp=1)
    whole = load_pickle(find(tmp_path / "pp1") / "mp_rank_00" / PER_RANK_FILE)
    flags = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    vars(whole["args"]).update(pipeline_model_parallel_size=2, **flags)
    counts = megatron_counts(megatron_ranks, LAYERS, 2, 4, flags)
    assert counts == [0, 1, 1, 1, 1, 1, 1, 0]
    write_stages(whole, tmp_path / "vp4", 0, 2, ["model0", "model1", "model2", "model3"], LAYERS, counts=counts)
    assert sorted(per_rank_dirs(tmp_path / "vp4")) == [(0, 0, 0), (0, 1, 0)]
    assert not PerRankModel(find(tmp_path / "vp4")).per_layer()  # its layers are alike: read stacked, not one by one
    assert_reads_back(tmp_path / "vp4", directory, cfg)


@pytest.mark.parametrize("flags, message", [
    (dict(pp=2, last_stage_layers=6), "--decoder-last-pipeline-num-layers 6: with --pp 2 it must leave model.num_layers=6 minus it, 0"),
    (dict(pp=4, first_stage_layers=1, last_stage_layers=2), "the 3 other layers must split evenly over the other 2 pp ranks"),
])  # fmt: skip
def test_to_megatron_refuses_an_uneven_split_megatron_refuses(saved, tmp_path, flags, message):
    directory, cfg = saved
    with pytest.raises(CheckpointError, match=message):
        to_megatron_per_rank(directory, cfg, tmp_path / "m", **flags)
    assert not (tmp_path / "m").exists()


def test_stages_that_disagree_with_their_args_split_are_one_error(saved, tmp_path):
    """Files cut 3 + 3 whose args say decoder_first_pipeline_num_layers=2 (a split of 2 + 4): the
    layers would land in the wrong places, so the read stops with one line naming both."""
    directory, cfg = saved
    to_megatron_per_rank(directory, cfg, tmp_path / "pp1", pp=1)
    whole = load_pickle(find(tmp_path / "pp1") / "mp_rank_00" / PER_RANK_FILE)
    vars(whole["args"]).update(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2)
    write_stages(whole, tmp_path / "pp2", 0, 2, ["model"], LAYERS, counts=[3, 3])
    message = r"pipeline stage 0 holds 3 layers, but its args' split \(num_layers=6, decoder_first_pipeline_num_layers=2\) over 2 stages gives 2"
    with pytest.raises(CheckpointError, match=message) as err:
        assert_reads_back(tmp_path / "pp2", directory, cfg)
    assert "\n" not in str(err.value)
