"""Megatron-LM's uneven pipeline split flags on train.py (dtgpt/config/pipeline_split.py): the
transformer layers each stage builds equal megatron-core's own answer (get_num_layers_to_build and
get_transformer_layer_offset on its TransformerConfig, for every pp rank and virtual stage), over
a table of splits; the splits Megatron refuses, and those dtgpt's stages cannot hold, are one
`error:` line naming the flag, its value and the rule, before any process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from dtgpt.cli import run_main
from dtgpt.config import ConfigError, load_config
from dtgpt.config.loading import to_toml
from dtgpt.parallel.pipeline import stage_layer_counts

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--global-batch-size", "16"]
INTERLEAVED = "--parallel.pipeline_schedule=Interleaved1F1B"

# (num_layers, pp, vp, dtgpt/Megatron flags, megatron-core's TransformerConfig fields of the same split)
CASES = {
    "even": (8, 4, 1, [], {}),
    "even_vp2": (16, 4, 2, ["--num-virtual-stages-per-pipeline-rank", "2", INTERLEAVED], {}),
    "first": (10, 4, 1, ["--decoder-first-pipeline-num-layers", "1"], dict(num_layers_in_first_pipeline_stage=1)),
    "last": (10, 4, 1, ["--decoder-last-pipeline-num-layers", "4"], dict(num_layers_in_last_pipeline_stage=4)),
    "first_last": (9, 4, 1, ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "2"],
                   dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=2)),
    "first_last_pp2": (5, 2, 1, ["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "3"],
                       dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=3)),
    "first_last_vp2": (20, 4, 2, ["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "6",
                                  "--num-virtual-stages-per-pipeline-rank", "2", INTERLEAVED],
                       dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=6)),
    "embedding": (7, 4, 1, ["--account-for-embedding-in-pipeline-split"], dict(account_for_embedding_in_pipeline_split=True)),
    "loss": (7, 2, 1, ["--account-for-loss-in-pipeline-split"], dict(account_for_loss_in_pipeline_split=True)),
    "embedding_loss": (6, 4, 1, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
                       dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    "embedding_loss_vp2": (14, 4, 2, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                                      "--num-virtual-stages-per-pipeline-rank", "2", INTERLEAVED],
                           dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    # one embedding-only virtual stage: 7 layers + the embedding over pp 2 x vp 4
    "embedding_layers_per_virtual_stage": (7, 2, 4, ["--account-for-embedding-in-pipeline-split",
                                                     "--num-layers-per-virtual-pipeline-stage", "1", INTERLEAVED],
                                           dict(account_for_embedding_in_pipeline_split=True)),
    "layers_per_virtual_stage": (12, 2, 3, ["--num-layers-per-virtual-pipeline-stage", "2", INTERLEAVED], {}),
    "layout": (8, 4, 1, ["--pipeline-model-parallel-layout", "Et|ttt|ttt|tL"], dict(pipeline_model_parallel_layout="Et|ttt|ttt|tL")),
    "layout_embedding_alone": (4, 2, 1, ["--pipeline-model-parallel-layout", "E|t*4L"], dict(pipeline_model_parallel_layout="E|t*4L")),
    # DeepSeek-V3's (Megatron-MoE-ModelZoo) at a quarter of the stages: pp 4 x vp 2, an MTP module beside the loss
    "layout_vp2_mtp": (13, 4, 2, ["--pipeline-model-parallel-layout", "Et|(tt|)*6,mL", "--mtp-num-layers", "1",
                                  "--position-embedding-type", "rope", INTERLEAVED],
                       dict(pipeline_model_parallel_layout="Et|(tt|)*6,mL", mtp_num_layers=1)),
    "layout_groups": (8, 2, 2, ["--pipeline-model-parallel-layout", "Et*2|(t|)*2,t*4L", INTERLEAVED],
                      dict(pipeline_model_parallel_layout="Et*2|(t|)*2,t*4L")),
}  # fmt: skip


@pytest.fixture
def megatron_ranks():
    """parallel_state's pp size and rank and vp size as plain values (no process group), put back after."""
    saved = (parallel_state._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE, parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK,
             parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE)  # fmt: skip

    def place(pp: int, rank: int, vp: int | None) -> None:
        parallel_state.set_pipeline_model_parallel_world_size(pp)
        parallel_state.set_pipeline_model_parallel_rank(rank)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)

    yield place
    place(*saved)


def megatron_counts(place, num_layers: int, pp: int, vp: int, fields: dict) -> list[int]:
    """megatron-core's layers of each stage v * pp + r, checked against its own layer offsets."""
    vp_size = vp if vp > 1 else None
    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                               pipeline_dtype=torch.float32, **{"virtual_pipeline_model_parallel_size": vp_size, **fields})  # fmt: skip
    counts = [0] * (pp * vp)
    for stage in range(pp * vp):
        v, r = divmod(stage, pp)
        place(pp, r, vp_size)
        vp_stage = v if vp_size else None
        counts[stage] = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=r)
        if pp > 1:  # megatron-core offsets only a pipeline's layers
            assert get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=r) == sum(counts[:stage]), stage
    return counts


def dtgpt_config(num_layers: int, pp: int, flags: list[str]):
    return load_config(None, [*MOCK, "--num-layers", str(num_layers), "--pipeline-model-parallel-size", str(pp), *flags])


@pytest.mark.parametrize("name", list(CASES))
def test_layers_per_stage_are_megatron_cores(megatron_ranks, name):
    num_layers, pp, vp, flags, fields = CASES[name]
    cfg = dtgpt_config(num_layers, pp, flags)
    assert cfg.parallel.virtual_pipeline_stages_per_rank == vp
    expected = megatron_counts(megatron_ranks, num_layers, pp, vp, fields)
    assert stage_layer_counts(cfg) == expected
    if fields:
        assert expected != [num_layers // (pp * vp)] * (pp * vp) or name == "embedding_loss"  # the table's splits are uneven


def test_deepseek_v3_layout_gives_its_configs_stages():
    """configs/deepseek_v3.toml's per-stage counts are Megatron-MoE-ModelZoo's layout string."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parent.parent / "configs" / "deepseek_v3.toml")
    explicit = load_config(config, [])
    layout = load_config(config, ["--parallel.pipeline_layers_per_stage=[]", "--pipeline-model-parallel-layout", "Et|(tt|)*30mL"])
    assert stage_layer_counts(layout) == stage_layer_counts(explicit)


def test_split_keys_round_trip_through_the_saved_config(tmp_path):
    """The resolved config (virtual stages derived from the layout and, none chosen, Megatron's
    interleaved schedule for them) reads back as the same split."""
    cfg = dtgpt_config(8, 2, ["--pipeline-model-parallel-layout", "Et*2|(t|)*2,t*4L"])
    assert cfg.parallel.pipeline_schedule == "Interleaved1F1B"
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    again = load_config(tmp_path / "c.toml", [])
    assert stage_layer_counts(again) == stage_layer_counts(cfg) == [2, 1, 1, 4]
    assert again.parallel.virtual_pipeline_stages_per_rank == 2
    assert dtgpt_config(8, 2, ["--num-layers-per-virtual-pipeline-stage", "2", "--parallel.pipeline_schedule=LoopedBFS"]).parallel.pipeline_schedule == "LoopedBFS"


# Refused by megatron-core itself (TransformerConfig / its layout) and by dtgpt, in the words typed.
MEGATRON_REFUSES = {
    "first_not_positive": (8, 4, 1, ["--decoder-first-pipeline-num-layers", "0"], dict(num_layers_in_first_pipeline_stage=0),
                           "--decoder-first-pipeline-num-layers 0 must be > 0"),
    "first_uneven_rest": (10, 4, 1, ["--decoder-first-pipeline-num-layers", "3"], dict(num_layers_in_first_pipeline_stage=3),
                          "--decoder-first-pipeline-num-layers 3: the 7 other layers must split evenly over the other 3 pp ranks"),
    "first_last_leave_too_many": (6, 2, 1, ["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
                                  dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2),
                                  "they must leave --num-layers 6 minus them, 2, 0: no other pp rank holds layers"),
    "first_vp": (12, 4, 2, ["--decoder-first-pipeline-num-layers", "3", "--num-virtual-stages-per-pipeline-rank", "2", INTERLEAVED],
                 dict(num_layers_in_first_pipeline_stage=3),
                 "--decoder-first-pipeline-num-layers 3 must be divisible by --num-virtual-stages-per-pipeline-rank 2"),
    "first_with_embedding": (8, 4, 1, ["--decoder-first-pipeline-num-layers", "2", "--account-for-embedding-in-pipeline-split"],
                             dict(num_layers_in_first_pipeline_stage=2, account_for_embedding_in_pipeline_split=True),
                             "cannot be combined with --account-for-embedding-in-pipeline-split"),
    "embedding_indivisible": (8, 4, 1, ["--account-for-embedding-in-pipeline-split"], dict(account_for_embedding_in_pipeline_split=True),
                              "--num-layers 8 + 1 = 9 must be divisible by --pipeline-model-parallel-size 4"),
    "layout_with_first": (8, 2, 1, ["--pipeline-model-parallel-layout", "Et|t*7L", "--decoder-first-pipeline-num-layers", "1"],
                          dict(pipeline_model_parallel_layout="Et|t*7L", num_layers_in_first_pipeline_stage=1),
                          "spells out every stage and cannot be combined with the other split keys"),
    "layout_layer_count": (8, 2, 1, ["--pipeline-model-parallel-layout", "Et|t*6L"], dict(pipeline_model_parallel_layout="Et|t*6L"),
                           "--pipeline-model-parallel-layout Et|t*6L holds 7 transformer layers (t), but --num-layers 8"),
    "layout_stages_vs_pp": (8, 2, 1, ["--pipeline-model-parallel-layout", "Et|tt|t*5L"], dict(pipeline_model_parallel_layout="Et|tt|t*5L"),
                            "has 3 stages, which must be a multiple of --pipeline-model-parallel-size 2"),
    "layout_letter": (8, 2, 1, ["--pipeline-model-parallel-layout", "Et|t*6xL"], dict(pipeline_model_parallel_layout="Et|t*6xL"),
                      "'x' is not a layer"),
    "layout_no_embedding": (8, 2, 1, ["--pipeline-model-parallel-layout", "tt|t*6L"], dict(pipeline_model_parallel_layout="tt|t*6L"),
                            "the embedding E must come once, first, on the first stage"),
    "layout_mtp_count": (8, 2, 1, ["--pipeline-model-parallel-layout", "Et|t*7L", "--mtp-num-layers", "1", "--position-embedding-type", "rope"],
                         dict(pipeline_model_parallel_layout="Et|t*7L", mtp_num_layers=1),
                         "holds 0 multi-token prediction modules (m), but --mtp-num-layers 1"),
    "layout_vp_conflict": (8, 2, 1, ["--pipeline-model-parallel-layout", "Et|tt|tt|ttL", "--num-virtual-stages-per-pipeline-rank", "3",
                                     INTERLEAVED], dict(pipeline_model_parallel_layout="Et|tt|tt|ttL", virtual_pipeline_model_parallel_size=3),
                           "gives 2 virtual stages per pp rank, but --num-virtual-stages-per-pipeline-rank 3"),
}  # fmt: skip

# Megatron runs these; dtgpt's stages cannot hold them (or Megatron-LM's argument checks refuse them).
DTGPT_REFUSES = {
    "layout_mtp_standalone": (8, 4, ["--pipeline-model-parallel-layout", "Ett|ttt|tttm|L", "--mtp-num-layers", "1",
                                     "--position-embedding-type", "rope"],
                              "the multi-token prediction modules m must follow every transformer layer, on the last stage"),
    "layout_empty_middle_stage": (8, 4, ["--pipeline-model-parallel-layout", "Ett||tttt|ttL"], "stage 1 holds no transformer layer"),
    "layout_empty_first_stage": (8, 4, ["--pipeline-model-parallel-layout", "|Ett|ttt|tttL"], "the embedding E must come once, first"),
    "layout_loss_before_last": (8, 4, ["--pipeline-model-parallel-layout", "Ett|ttt|tttL|"], "the loss L must come once, last"),
    "layout_v_schedule": (8, 2, ["--pipeline-model-parallel-layout", "Et|ttt|ttt|tL", "--parallel.pipeline_schedule=ZBVZeroBubble"],
                          "places them in a V; give parallel.pipeline_layers_per_stage instead"),
    "layers_per_virtual_stage_with_first": (8, 2, ["--num-layers-per-virtual-pipeline-stage", "2", "--decoder-first-pipeline-num-layers", "2",
                                                   INTERLEAVED], "give the virtual stages as --num-virtual-stages-per-pipeline-rank"),
    "layers_per_virtual_stage_indivisible": (8, 2, ["--num-layers-per-virtual-pipeline-stage", "3", INTERLEAVED],
                                             "--num-layers-per-virtual-pipeline-stage 3: the layers of each pp rank"),
    "explicit_counts_too": (8, 2, ["--decoder-last-pipeline-num-layers", "3", "--parallel.pipeline_layers_per_stage=[4,4]"],
                            "both choose the pipeline split; keep one"),
    "first_at_pp1": (8, 1, ["--decoder-first-pipeline-num-layers", "8"], "splits a pipeline, but --pipeline-model-parallel-size 1: it must be > 1"),
}  # fmt: skip


def _one_error_line(capfd, argv: list[str], message: str) -> None:
    code = run_main([*MOCK, *argv], None, None)
    out, err = capfd.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("error:") and message in err, err
    assert "Traceback" not in err and not dist.is_initialized()


@pytest.mark.parametrize("name", list(MEGATRON_REFUSES))
def test_splits_megatron_refuses_are_one_error_line(megatron_ranks, capfd, name):
    num_layers, pp, vp, flags, fields, message = MEGATRON_REFUSES[name]
    with pytest.raises((ValueError, AssertionError)):
        megatron_counts(megatron_ranks, num_layers, pp, vp, fields)
    _one_error_line(capfd, ["--num-layers", str(num_layers), "--pipeline-model-parallel-size", str(pp), *flags], message)


@pytest.mark.parametrize("name", list(DTGPT_REFUSES))
def test_splits_dtgpt_cannot_run_are_one_error_line(capfd, name):
    num_layers, pp, flags, message = DTGPT_REFUSES[name]
    _one_error_line(capfd, ["--num-layers", str(num_layers), "--pipeline-model-parallel-size", str(pp), *flags], message)


def test_split_keys_from_toml(tmp_path):
    """The keys are also [parallel]'s, settable as --parallel.x= and refused the same way there."""
    cfg = load_config(None, [*MOCK, "--model.num_layers=10", "--parallel.pipeline_model_parallel_size=4",
                             "--parallel.decoder_last_pipeline_num_layers=1"])  # fmt: skip
    assert stage_layer_counts(cfg) == [3, 3, 3, 1]
    with pytest.raises(ConfigError, match=r"^parallel.decoder_last_pipeline_num_layers=2: the 8 other layers"):
        load_config(None, [*MOCK, "--model.num_layers=10", "--parallel.pipeline_model_parallel_size=4",
                           "--parallel.decoder_last_pipeline_num_layers=2"])  # fmt: skip
