"""Megatron checkpoints of a multi-latent attention + MoE + multi-token prediction model in and
out, with megatron-core's own GPTModel as the oracle.

One megatron-core launch on 2 gloo ranks at tp 2 (tests/megatron_mla_gpt.py): a 3-layer
DeepSeek-style model (MLA with a compressed query, its norms and YaRN; a dense layer, then two of
sigmoid-routed experts with the expert bias, group-limited, scaled, and a shared expert, which
megatron-core stores layer by layer; one MTP layer) saves torch_dist twice, the norms of the
compressed vectors under the local layer spec's names and under Transformer Engine's, and
Megatron-LM's per-rank files (mp_rank_00, mp_rank_01), and records its logits (the main model's
and the MTP depth's), LM loss and MTP loss; in the same launch it loads the checkpoints dtgpt
wrote before it (to-megatron, torch_dist and per-rank at tp 2) into a model from another seed and
records those. dtgpt must give the same logits and losses both ways.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import dtgpt
from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.export import load_model, read_config
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, load_pickle
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import ModelConfig
from dtgpt.data.batch import IGNORE_INDEX
from dtgpt.mtp import depth_labels
from tests.megatron_gpt import CONSUMED, ITERATION, VOCAB, labels, tokens
from tests.megatron_mla_gpt import DENSE, EXPERTS, HEADS, HIDDEN, LATENT, LAYERS, MOE, MOE_LAYERS, MTP
from tests.parity_oracle import assert_same_training
from tests.runs import Command, launch_commands, read_run, run_args
from tests.test_checkpoint_convert import load_script
from tests.test_megatron_checkpoint import write_stages
from tests.test_megatron_moe_checkpoint import assert_converts_back, launch, save_dtgpt

PP2 = ["--format", "per-rank", "--pp", "2", "--decoder-first-pipeline-num-layers", "1"]
"""Megatron-LM's split of the 3 layers that megatron_mla_gpt.py's pp 2 stages build: the dense one first."""
ROWS = 128  # 100 padded to a multiple of 16 x tp 2, Megatron's
SCRIPT = Path(__file__).with_name("megatron_mla_gpt.py")
MODEL = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=32, hidden_dropout=0.0,
             attention_dropout=0.0, make_vocab_size_divisible_by=32, position_embedding_type="rope", swiglu=True,
             untie_embeddings_and_output_weights=True, multi_latent_attention=True, num_experts=EXPERTS,
             moe_layer_freq=str(MOE_LAYERS), **MTP, **DENSE, **LATENT, **MOE)  # fmt: skip


def model_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{**MODEL, **overrides})


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours[..., :VOCAB], theirs[..., :VOCAB]
    return ((ours - theirs).norm() / theirs.norm()).item()


@torch.no_grad()
def head_outputs(model) -> torch.Tensor:
    """(1 + MTP depths, B, T, vocabulary rows): dtgpt's logits of tokens(), the main model's then
    each depth's (a model in training mode gives the depths' too; dropout is 0)."""
    model.train()
    out = torch.stack(model(tokens()))
    model.eval()
    return out


def assert_same_outputs(ours: torch.Tensor, root: Path, prefix: str = "") -> None:
    theirs = torch.load(root / f"{prefix}logits.pt", weights_only=True)
    assert ours.shape == theirs.shape  # the main model's logits and the MTP depth's
    for depth in range(len(ours)):
        assert relative_error(ours[depth], theirs[depth]) < 1e-5, depth
    torch.testing.assert_close(loss_of(ours[0]), torch.load(root / f"{prefix}loss.pt", weights_only=True), rtol=1e-5, atol=0)
    # each depth's loss on its shifted labels (the last positions ignored), as Megatron tracks it
    mtp = torch.stack([torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX)
                       for logits, shifted in zip(ours[1:], depth_labels(labels(), len(ours) - 1))])  # fmt: skip
    torch.testing.assert_close(mtp, torch.load(root / f"{prefix}mtp_loss.pt", weights_only=True), rtol=1e-5, atol=0)


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """megatron-core's loss as tests/megatron_gpt.py takes it: the token mean over every padded row."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels().flatten())


@pytest.fixture(scope="module")
def mla_root(tmp_path_factory) -> Path:
    """dtgpt's checkpoint and its to-megatron conversion, then megatron-core's launch at tp 2."""
    root = tmp_path_factory.mktemp("megatron_mla")
    save_dtgpt(root / "dtgpt", MODEL)
    assert load_script().main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt")]) == 0
    per_rank = ["--format", "per-rank", "--tp", "2"]
    assert load_script().main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt_per_rank"), *per_rank]) == 0
    assert load_script().main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt_pp2"), *PP2]) == 0
    torch.save(first_batch(), root / "batch.pt")  # megatron-core's losses on it: batch_losses.pt
    launch(SCRIPT, root)
    return root


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


@pytest.fixture(scope="module")
def dtgpt_mla(tmp_path_factory) -> Path:
    """dtgpt's MLA checkpoint alone (no megatron-core launch)."""
    root = tmp_path_factory.mktemp("dtgpt_mla")
    save_dtgpt(root, MODEL)
    return root


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
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    for stage in ("mp_rank_00_000", "mp_rank_00_001"):
        mine, megatron = (load_pickle(d / stage / PER_RANK_FILE)["model"] for d in (ours, theirs))
        assert sorted(mine) == sorted(megatron), stage
        for key, value in megatron.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine[key], value), (stage, key)
    assert "decoder.layers.2.mlp.router.weight" not in mine and "decoder.layers.1.mlp.router.weight" in mine
    assert [(mla_root / f"loaded_pp2_{r}.ok").read_text() for r in range(2)] == ["strict", "strict"]
    assert_same_outputs(head_outputs(load_megatron_model(theirs, model_cfg(), ROWS)), mla_root)


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


LOADED_LAYOUTS = ("tp2", "pp2", "ep2")
"""dtgpt meshes of 2 ranks the Megatron checkpoints load into (tests/megatron_family_worker.py)."""
STAGES = {"pp2": {"pipeline_layers_per_stage": [1, LAYERS - 1]}}
"""Megatron's split at pp 2 (decoder_first_pipeline_num_layers=1): the dense layer, then the two MoE layers and the MTP block."""
STEPS = 2
"""iterations a run resumed from megatron-core's checkpoint (iteration 7) trains"""
TRAIN_ON = [*(f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODEL.items()),
            "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer", f"--data.vocab_size={VOCAB}", "--data.num_workers=0",
            "--training.micro_batch_size=2", "--training.global_batch_size=8", f"--training.train_iters={ITERATION + STEPS}",
            "--optimizer.lr=3e-3", "--optimizer.lr_warmup_iters=2", "--eval.eval_iters=0", "--logging.log_interval=1"]  # fmt: skip
"""train.py on from megatron-core's checkpoint: its model, 8 samples a global batch as its 56 consumed ones"""
TRAINED_ON = {"one": (1, []), "tp2": (2, ["--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]),
              "pp2": (2, ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_layers_per_stage=[1,2]"])}  # fmt: skip


def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of the global batch a run of TRAIN_ON resumed at megatron-core's consumed
    samples trains on first (dtgpt's data order, read here as train.py reads it)."""
    from dtgpt.config import load_config

    cfg = load_config(None, TRAIN_ON + ["--training.micro_batch_size=8"])
    batch = next(dtgpt.build_train_iterator(cfg, dtgpt.build_model(cfg, dtgpt.init_distributed(cfg), VOCAB), CONSUMED))
    return batch.tokens, batch.labels


@pytest.fixture(scope="module")
def mla_on_dtgpt_meshes(mla_root, tmp_path_factory) -> dict:
    """One launch per rank count (tests/runs.py): on 2 ranks the checkpoint loads of
    tests/megatron_family_worker.py (torch_dist and per-rank at LOADED_LAYOUTS), then train.py on
    from megatron-core's torch_dist checkpoint at tp 2 + SP and pp 2; on one process the same run.
    {key: Finished}; the runs' directories by key under "directories"."""
    jobs = [[str(mla_root / root), MODEL, list(LOADED_LAYOUTS), STAGES] for root in ("megatron", "megatron_per_rank")]
    commands = [Command("loads", tmp_path_factory.mktemp("loads"), [json.dumps(jobs)], 2, call="tests.megatron_family_worker:main")]
    directories = {}
    for name, (nproc, mesh) in TRAINED_ON.items():
        directories[name] = tmp_path_factory.mktemp(name)
        argv = run_args(directories[name], [*mesh, f"--checkpoint.load={mla_root / 'megatron'}"], name, TRAIN_ON, 0)
        commands.append(Command(name, directories[name], argv, nproc))
    return {**launch_commands(commands), "directories": directories}


@pytest.mark.slow
def test_megatron_mla_moe_mtp_checkpoints_load_into_dtgpt_at_tp2_pp2_and_ep2(mla_root, mla_on_dtgpt_meshes):
    """checkpoint.load of megatron-core's torch_dist and per-rank (tp 2) checkpoints of the MLA +
    MoE + MTP model on 2 dtgpt ranks: at tp 2 with sequence parallelism (the MoE blocks' experts
    and routers with the expert bias split as every block's), at pp 2 (the MTP block and the
    embedding copy it reads on the last stage, which embeds the tokens itself) and with the
    experts over ep 2: the main model's and the MTP depth's logits, the LM loss and the MTP loss
    are megatron-core's."""
    mla_on_dtgpt_meshes["loads"].checked()
    for root in ("megatron", "megatron_per_rank"):
        for name in LOADED_LAYOUTS:
            assert_same_outputs(torch.load(mla_root / root / f"{name}_logits.pt", weights_only=True), mla_root)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_megatron_mla_moe_mtp_checkpoint_trains_on_at_tp2_and_pp2_as_one_process(mla_root, mla_on_dtgpt_meshes, name):
    """train.py resumed from megatron-core's checkpoint goes on from its iteration and consumed
    samples; its first loss and MTP loss are megatron-core's own on that global batch, and at tp 2
    + SP and pp 2 it trains as one process does: the loss, MTP loss, gradient norm and router
    statistics of each iteration and every parameter after the last (tests/parity_oracle.py)."""
    runs = {}
    for key in ("one", name):
        output = mla_on_dtgpt_meshes[key].checked()
        assert f"loaded Megatron checkpoint {mla_root / 'megatron'}/iter_{ITERATION:07d}: iteration {ITERATION}, consumed samples {CONSUMED}" in output
        run = read_run(mla_on_dtgpt_meshes["directories"][key], key)
        runs[key] = {**run, "params": {STEPS: run["params"][ITERATION + STEPS]}}  # numbered from the resume
    one = runs["one"]
    assert one["iteration"] == [ITERATION + 1 + i for i in range(STEPS)] and one["consumed_samples"][0] == CONSUMED + 8
    theirs = torch.load(mla_root / "batch_losses.pt", weights_only=True)  # [LM loss, mtp_1 loss]
    assert one["loss"][0] == pytest.approx(theirs[0].item(), rel=1e-5)
    assert one["mtp_1 loss"][0] == pytest.approx(theirs[1].item(), rel=1e-5)
    assert_same_training(runs[name], one, STEPS)
