"""Megatron checkpoints of a multi-latent attention + MoE + multi-token prediction model in and
out (the weights), with megatron-core's own GPTModel as the oracle.

One megatron-core launch on 2 gloo ranks at tp 2 (tests/megatron_mla_gpt.py, through conftest's
mla_root): a 3-layer DeepSeek-style model (MLA with a compressed query, its norms and YaRN; a
dense layer, then two of sigmoid-routed experts with the expert bias, group-limited, scaled, and a
shared expert, which megatron-core stores layer by layer; one MTP layer) saves torch_dist twice,
the norms of the compressed vectors under the local layer spec's names and under Transformer
Engine's, and Megatron-LM's per-rank files (mp_rank_00, mp_rank_01), and records its logits (the
main model's and the MTP depth's), LM loss and MTP loss; in the same launch it loads the
checkpoints dtgpt wrote before it (to-megatron, torch_dist and per-rank at tp 2) into a model from
another seed and records those. dtgpt must give the same logits and losses both ways. Resuming
training from them: test_megatron_mla_resume.py; their Adam state in buckets: test_megatron_mla_buckets.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.export import load_model, read_config
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, load_pickle
from dtgpt.checkpoint.megatron.reader import MegatronReader
from tests.megatron_mla_gpt import DENSE, EXPERTS, HEADS, HIDDEN, LATENT, LAYERS, MOE
from tests.megatron_mla_oracle import PP2, ROWS, TIED, assert_same_outputs, head_outputs, model_cfg, relative_error
from tests.test_checkpoint_convert import load_script
from tests.megatron_checkpoints import write_stages
from tests.test_megatron_moe_checkpoint import assert_converts_back


@pytest.mark.slow
@pytest.mark.parametrize("saved", ["megatron", "megatron_te"])
def test_megatron_mla_moe_torch_dist_gives_megatrons_logits_and_loss(mla_root, saved):
    """Either layer spec's names of the compressed vectors' norms; saved at tp 2, read whole."""
    directory = find(mla_root / saved)
    shapes = MegatronReader(directory).shapes
    norm = "linear_q_up_proj.layer_norm_weight" if saved == "megatron_te" else "q_layernorm.weight"
    assert shapes[f"decoder.layers.1.self_attention.{norm}"] == (LATENT["q_lora_rank"],)
    # [compressed | k_pe] rows, whichever spec's linear (column-parallel or duplicated) saved them
    assert shapes["decoder.layers.2.self_attention.linear_kv_down_proj.weight"] == (16 + 8, HIDDEN)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * DENSE["ffn_hidden_size"], HIDDEN)  # layer by layer
    assert shapes["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == (EXPERTS, 2 * MOE["moe_ffn_hidden_size"], HIDDEN)
    assert shapes["mtp.layers.0.eh_proj.weight"] == (HIDDEN, 2 * HIDDEN)
    model = load_megatron_model(directory, model_cfg(), ROWS)
    assert model.layers["1"].mlp.router.expert_bias.abs().min() > 0  # Megatron's drawn bias, not the zero init
    assert model.mtp.layers[0].transformer_layer.mlp.router.expert_bias.abs().min() > 0
    assert_same_outputs(head_outputs(model), mla_root)


@pytest.mark.slow
def test_dtgpt_mla_moe_checkpoint_to_megatron_loads_in_megatron_core_with_equal_logits_and_loss(mla_root, tmp_path):
    saved = layout.iteration_dir(mla_root / "dtgpt", 3)
    assert_same_outputs(head_outputs(load_model(saved, read_config(saved))), mla_root, "loaded_")
    # written with Transformer Engine's names (Megatron-LM's default layer spec), layer by layer
    shapes = MegatronReader(find(mla_root / "from_dtgpt")).shapes
    assert "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight" in shapes
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in shapes  # a dense layer's pre-MLP norm, fused
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in shapes  # an MoE layer's, a module of its own
    assert "mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight" in shapes
    assert_converts_back(mla_root / "from_dtgpt", saved, tmp_path / "back")


@pytest.mark.slow
@pytest.mark.parametrize("overrides, key", [
    (dict(multi_latent_attention=False, q_lora_rank=None, rope_type=None, rotary_scaling_factor=1.0, mscale=1.0,
          mscale_all_dim=0.0, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128),
     "model.multi_latent_attention: the checkpoint has true but the config has false"),
    (dict(q_lora_rank=None), "model.q_lora_rank: the checkpoint has 24 but the config has unset"),
    (dict(kv_lora_rank=32), "model.kv_lora_rank: the checkpoint has 16 but the config has 32"),
    (dict(rope_type="rope"), "model.rope_type: the checkpoint has 'yarn' but the config has 'rope'"),
    (dict(moe_router_group_topk=1), "model.moe_router_group_topk: the checkpoint has 2 but the config has 1"),
    (dict(moe_layer_freq=1), r"model.moe_layer_freq: the checkpoint has \[0, 1, 1\] but the config has 1"),
    (dict(mtp_num_layers=None, mtp_loss_scaling_factor=0.1), "model.mtp_num_layers: the checkpoint has 1 but the config has unset"),
])  # fmt: skip
def test_an_mla_architecture_other_than_megatrons_args_is_one_error(mla_root, overrides, key):
    with pytest.raises(CheckpointError, match=key) as err:
        load_megatron_model(find(mla_root / "megatron"), model_cfg(**overrides), ROWS)
    assert "\n" not in str(err.value)


def per_rank_file(root: Path, tp: int) -> dict:
    return torch.load(find(root) / f"mp_rank_{tp:02d}" / "model_optim_rng.pt", weights_only=False)["model"]


@pytest.mark.slow
def test_megatron_mla_moe_per_rank_files_at_tp2_give_megatrons_logits_and_loss(mla_root):
    """megatron-core's own per-rank files: each tp rank's split, as measured here, and dtgpt
    glues them back into megatron-core's model."""
    first, second = per_rank_file(mla_root / "megatron_per_rank", 0), per_rank_file(mla_root / "megatron_per_rank", 1)
    attention = "decoder.layers.1.self_attention."
    # column parallel (rows split by tp): the up-projections (by head), and under the local spec the down-projections
    assert first[attention + "linear_q_up_proj.weight"].shape == (HEADS // 2 * (12 + 8), LATENT["q_lora_rank"])
    assert first[attention + "linear_kv_up_proj.weight"].shape == (HEADS // 2 * (12 + 10), LATENT["kv_lora_rank"])
    assert first[attention + "linear_q_down_proj.weight"].shape == (LATENT["q_lora_rank"] // 2, HIDDEN)
    assert first[attention + "linear_kv_down_proj.weight"].shape == ((16 + 8) // 2, HIDDEN)
    assert first["mtp.layers.0.eh_proj.weight"].shape == (HIDDEN // 2, 2 * HIDDEN)
    assert first[attention + "linear_proj.weight"].shape == (HIDDEN, HEADS // 2 * 10)  # row parallel
    for norm in (attention + "q_layernorm.weight", attention + "kv_layernorm.weight", "mtp.layers.0.enorm.weight",
                 "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight"):  # fmt: skip
        assert torch.equal(first[norm], second[norm]), norm  # replicated
    model = load_megatron_model(find(mla_root / "megatron_per_rank"), model_cfg(), ROWS)
    assert_same_outputs(head_outputs(model), mla_root)


@pytest.mark.slow
def test_megatron_mla_moe_per_rank_files_cut_into_pp2_give_megatrons_logits_and_loss(mla_root, tmp_path):
    """The same files as Megatron-LM saves them at pp 2 with the first stage's one layer (the
    dense one; its args say decoder_first_pipeline_num_layers=1): the MTP block on the last stage."""
    directory = find(mla_root / "megatron_per_rank")
    for tp in range(2):
        saved = load_pickle(directory / f"mp_rank_{tp:02d}" / PER_RANK_FILE)
        vars(saved["args"]).update(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)
        write_stages(saved, tmp_path, tp, 2, ["model"], LAYERS, counts=[1, LAYERS - 1])
    assert "mtp.layers.0.eh_proj.weight" in load_pickle(tmp_path / "mp_rank_00_001" / PER_RANK_FILE)["model"]
    assert_same_outputs(head_outputs(load_megatron_model(tmp_path, model_cfg(), ROWS)), mla_root)


@pytest.mark.slow
def test_dtgpt_mla_moe_per_rank_files_load_in_megatron_core_at_tp2_with_equal_logits_and_loss(mla_root, tmp_path):
    """to-megatron --format per-rank --tp 2: megatron-core's ranks each load their own file
    strictly (every key, _extra_state included) and give dtgpt's logits and losses."""
    saved = layout.iteration_dir(mla_root / "dtgpt", 3)
    assert_same_outputs(head_outputs(load_model(saved, read_config(saved))), mla_root, "loaded_per_rank_")
    assert_converts_back(mla_root / "from_dtgpt_per_rank", saved, tmp_path / "back")


@pytest.mark.slow
def test_dtgpt_pp2_per_rank_files_equal_megatron_cores_own_save_at_pp2(mla_root, tmp_path):
    """megatron-core's stages at pp 2 load its torch_dist checkpoint and save their per-rank files
    (mp_rank_00_000: the embedding and the dense layer; mp_rank_00_001: the two MoE layers numbered
    0 and 1, the final norm, the head, the MTP block and the embedding it uses); dtgpt's
    to-megatron --pp 2 of the same weights writes the same files key for key and tensor for
    tensor, megatron-core's stages load dtgpt's own strictly, and dtgpt reads megatron-core's
    back into its logits."""
    assert load_script().main(["from-megatron", str(mla_root / "megatron"), str(tmp_path / "d"), "--config",
                               str(layout.iteration_dir(mla_root / "dtgpt", 3) / "config.toml")]) == 0  # fmt: skip
    assert load_script().main(["to-megatron", str(tmp_path / "d"), str(tmp_path / "m"), *PP2]) == 0
    ours, theirs = find(tmp_path / "m"), find(mla_root / "megatron_pp2")
    mine = assert_same_stage_files(ours, theirs)
    assert "decoder.layers.2.mlp.router.weight" not in mine and "decoder.layers.1.mlp.router.weight" in mine
    assert [(mla_root / f"loaded_pp2_{r}.ok").read_text() for r in range(2)] == ["strict", "strict"]
    assert_same_outputs(head_outputs(load_megatron_model(theirs, model_cfg(), ROWS)), mla_root)


def assert_same_stage_files(ours: Path, theirs: Path) -> dict:
    """Two pp 2 per-rank iterations hold the same keys and tensors, stage by stage; the last stage's model."""
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    for stage in ("mp_rank_00_000", "mp_rank_00_001"):
        mine, megatron = (load_pickle(d / stage / PER_RANK_FILE)["model"] for d in (ours, theirs))
        assert sorted(mine) == sorted(megatron), stage
        for key, value in megatron.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine[key], value), (stage, key)
    return mine


@pytest.mark.slow
def test_tied_pp2_per_rank_files_load_both_ways_with_equal_logits(mla_root):
    """With the head tied to the word embedding, at pp 2: megatron-core's two tied stages each load
    their file of dtgpt's to-megatron --format per-rank --pp 2 strictly and, run as a pipeline,
    give dtgpt's logits of the main model and of the MTP depth; and dtgpt reads the stages' own
    per-rank save back into those logits, whose last stage holds an output_layer.weight that is
    not the embedding (megatron-core reads the head from the MTP block's embedding copy and leaves
    that tensor at its init: dtgpt must not read it)."""
    saved = layout.iteration_dir(mla_root / "dtgpt_tied", 3)
    ours = head_outputs(load_model(saved, read_config(saved)))
    theirs = torch.load(mla_root / "loaded_tied_pp2_logits.pt", weights_only=True)
    assert ours.shape == theirs.shape
    megatrons = find(mla_root / "megatron_tied_pp2")
    last = load_pickle(megatrons / "mp_rank_00_001" / PER_RANK_FILE)["model"]
    assert not torch.equal(last["output_layer.weight"], last["embedding.word_embeddings.weight"])
    back = head_outputs(load_megatron_model(megatrons, model_cfg(**TIED), ROWS))
    for depth in range(len(ours)):
        assert relative_error(ours[depth], theirs[depth]) < 1e-5, depth
        assert relative_error(back[depth], theirs[depth]) < 1e-5, depth

