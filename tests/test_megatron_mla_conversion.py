"""dtgpt's Megatron conversion of a multi-latent attention + MoE + multi-token prediction model,
without megatron-core: to-megatron and back in both formats, Transformer Engine's per-rank names,
and the one-line errors of damaged files and pipeline splits Megatron would not build
(tests/test_megatron_mla_checkpoint.py holds the checks against megatron-core itself).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, load_pickle
from dtgpt.checkpoint.megatron.reader import MegatronReader
from tests.megatron_mla_gpt import HIDDEN
from tests.test_checkpoint_convert import load_script
from tests.megatron_mla_oracle import MODEL, PP2, ROWS, model_cfg
from tests.test_megatron_moe_checkpoint import assert_converts_back, save_dtgpt


@pytest.fixture(scope="module")
def dtgpt_mla(tmp_path_factory) -> Path:
    """dtgpt's MLA checkpoint alone (no megatron-core launch)."""
    root = tmp_path_factory.mktemp("dtgpt_mla")
    save_dtgpt(root, MODEL)
    return root



@pytest.mark.parametrize("damage, message", [
    (lambda model: model.pop("decoder.layers.2.self_attention.linear_kv_up_proj.weight"),
     "mp_rank_01/model_optim_rng.pt has no decoder.layers.2.self_attention.linear_kv_up_proj.weight"),
    (lambda model: model.update({"mtp.layers.0.eh_proj.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}),
     r"mp_rank_01/model_optim_rng.pt holds mtp.layers.0.eh_proj.weight of shape \(64, 128\) but tp rank 0's file \(32, 128\)"),
])  # fmt: skip
def test_a_damaged_mla_per_rank_file_is_one_error_naming_the_file_and_key(dtgpt_mla, tmp_path, damage, message):
    assert load_script().main(["to-megatron", str(dtgpt_mla), str(tmp_path / "m"), "--format", "per-rank", "--tp", "2"]) == 0
    path = find(tmp_path / "m") / "mp_rank_01" / "model_optim_rng.pt"
    saved = torch.load(path, weights_only=False)
    damage(saved["model"])
    torch.save(saved, path)
    with pytest.raises(CheckpointError, match=message) as err:
        load_megatron_model(find(tmp_path / "m"), model_cfg(make_vocab_size_divisible_by=16), ROWS)
    assert "\n" not in str(err.value)


def test_mla_per_rank_files_of_transformer_engines_spec_read_back_whole(dtgpt_mla, tmp_path):
    """Megatron-LM's default (Transformer Engine) spec builds MLA's down-projections as TELinear
    with parallel_mode='duplicated' (megatron-core's multi_latent_attention.py) and fuses the
    compressed vectors' norms into the up-projections (layer_norm_weight): its files, made here
    from dtgpt's local-spec ones (Transformer Engine does not run on CPU), read back the same."""
    assert load_script().main(["to-megatron", str(dtgpt_mla), str(tmp_path / "m"), "--format", "per-rank", "--tp", "2"]) == 0
    directory = find(tmp_path / "m")
    files = [load_pickle(directory / f"mp_rank_{tp:02d}" / PER_RANK_FILE) for tp in range(2)]
    whole = {k: torch.cat([files[0]["model"][k], files[1]["model"][k]]) for k in files[0]["model"] if k.endswith("_down_proj.weight")}
    for saved in files:
        saved["model"].update(whole)  # the down-projections whole on every tp rank
        for key in [k for k in saved["model"] if k.endswith(("q_layernorm.weight", "kv_layernorm.weight"))]:
            prefix, norm, _ = key.rsplit(".", 2)
            saved["model"][f"{prefix}.linear_{norm.removesuffix('_layernorm')}_up_proj.layer_norm_weight"] = saved["model"].pop(key)
    for tp, saved in enumerate(files):
        torch.save(saved, directory / f"mp_rank_{tp:02d}" / PER_RANK_FILE)
    assert MegatronReader(directory).shapes["decoder.layers.1.self_attention.linear_kv_down_proj.weight"] == (16 + 8, HIDDEN)
    assert_converts_back(tmp_path / "m", layout.iteration_dir(dtgpt_mla, 3), tmp_path / "back")


@pytest.mark.parametrize("fmt", [[], ["--format", "per-rank", "--tp", "2"],
                                 ["--format", "per-rank", "--tp", "2", "--pp", "2", "--decoder-first-pipeline-num-layers", "1"],
                                 ["--format", "per-rank", "--pp", "2", "--decoder-last-pipeline-num-layers", "2"]],
                         ids=["torch_dist", "per_rank", "per_rank_pp2", "per_rank_pp2_last"])  # fmt: skip
def test_mla_round_trip_without_megatron(dtgpt_mla, tmp_path, fmt):
    """to-megatron then from-megatron gives every tensor back (the key map both ways, layers apart)."""
    assert load_script().main(["to-megatron", str(dtgpt_mla), str(tmp_path / "m"), *fmt]) == 0
    assert_converts_back(tmp_path / "m", layout.iteration_dir(dtgpt_mla, 3), tmp_path / "back")


@pytest.mark.parametrize("flags, message", [
    (["--pp", "2"], "--pp 2: Megatron splits model.num_layers=3 evenly over the pipeline stages"),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "3"], "--decoder-first-pipeline-num-layers 3: with --pp 2 it must leave"),
    (["--pp", "0"], "--pp 0: the pipeline parallel size must be at least 1"),
    (["--pp", "2", "--decoder-last-pipeline-num-layers", "0"], "--decoder-last-pipeline-num-layers 0 must be > 0"),
])  # fmt: skip
def test_to_megatron_refuses_a_pipeline_split_in_one_line(dtgpt_mla, tmp_path, capfd, flags, message):
    assert load_script().main(["to-megatron", str(dtgpt_mla), str(tmp_path / "out"), "--format", "per-rank", *flags]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]
    assert not (tmp_path / "out").exists()


def drop_stage(directory: Path) -> None:
    for path in sorted((directory / "mp_rank_01_001").iterdir()):
        path.unlink()
    (directory / "mp_rank_01_001").rmdir()


def stage_swapped(directory: Path) -> None:
    """tp rank 1's last-stage file replaced by its first stage's: one stage in the wrong place."""
    saved = load_pickle(directory / "mp_rank_01_000" / PER_RANK_FILE)
    torch.save(saved, directory / "mp_rank_01_001" / PER_RANK_FILE)


@pytest.mark.parametrize("damage, message", [
    (drop_stage, r"lack \(tp 1, pp 1, ep 0\)'s model_optim_rng.pt"),
    (stage_swapped, "mp_rank_01_001/model_optim_rng.pt has no "),
], ids=["missing_stage", "pp_layout"])  # fmt: skip
def test_pp2_per_rank_files_of_another_layout_are_one_error_line(dtgpt_mla, tmp_path, capfd, damage, message):
    """dtgpt's pp 2 files with a stage directory gone, or args whose split the files do not
    follow: from-megatron says so in one line naming the checkpoint, and writes nothing."""
    flags = ["--format", "per-rank", "--tp", "2", *PP2[2:]]
    assert load_script().main(["to-megatron", str(dtgpt_mla), str(tmp_path / "m"), *flags]) == 0
    damage(find(tmp_path / "m"))
    capfd.readouterr()
    config = layout.iteration_dir(dtgpt_mla, 3) / "config.toml"
    assert load_script().main(["from-megatron", str(tmp_path / "m"), str(tmp_path / "back"), "--config", str(config)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and str(find(tmp_path / "m")) in err[0], err
    assert re.search(message, err[0]), err[0]
    assert not layout.iteration_dir(tmp_path / "back", 3).exists()

