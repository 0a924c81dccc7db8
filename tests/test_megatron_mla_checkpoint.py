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
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import dtgpt
from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.export import load_model, read_config
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, load_pickle
from dtgpt.checkpoint.megatron.keys import OPTIMIZER_PREFIX, full_model_shapes, is_buffer, megatron_name, stored_alias
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import ModelConfig, OptimizerConfig
from dtgpt.data.batch import IGNORE_INDEX
from dtgpt.model import GPT
from dtgpt.mtp import depth_labels
from dtgpt.muon import MUON, muon_matrices
from dtgpt.optim import build_optimizer
from tests.megatron_adam import ADAM
from tests.megatron_gpt import CONSUMED, ITERATION, VOCAB, labels, tokens
from tests.megatron_mla_adam import SCHEDULE
from tests.megatron_mla_gpt import DENSE, EXPERTS, HEADS, HIDDEN, LATENT, LAYERS, MOE, MOE_LAYERS, MTP
from tests.parity_oracle import assert_same_figures, assert_same_training
from tests.runs import Command, launch_commands, read_run, run_args
from tests.test_checkpoint_convert import load_script
from tests.megatron_checkpoints import write_stages
from tests.test_megatron_moe_checkpoint import assert_converts_back, launch, save_dtgpt

PP2 = ["--format", "per-rank", "--pp", "2", "--decoder-first-pipeline-num-layers", "1"]
"""Megatron-LM's split of the 3 layers that megatron_mla_gpt.py's pp 2 stages build: the dense one first."""
ROWS = 128  # 100 padded to a multiple of 16 x tp 2, Megatron's
SCRIPT = Path(__file__).with_name("megatron_mla_gpt.py")
MODEL = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=32, hidden_dropout=0.0,
             attention_dropout=0.0, make_vocab_size_divisible_by=32, position_embedding_type="rope", swiglu=True,
             untie_embeddings_and_output_weights=True, multi_latent_attention=True, num_experts=EXPERTS,
             moe_layer_freq=str(MOE_LAYERS), **MTP, **DENSE, **LATENT, **MOE)  # fmt: skip


TIED = {**MODEL, "untie_embeddings_and_output_weights": False}


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
    save_dtgpt(root / "dtgpt_tied", TIED)  # megatron-core's tied stages load its pp 2 files
    assert load_script().main(["to-megatron", str(root / "dtgpt_tied"), str(root / "from_dtgpt_tied_pp2"), *PP2]) == 0
    torch.save(first_batch(), root / "batch.pt")  # megatron-core's losses on it: batch_losses.pt
    launch(SCRIPT, root)
    return root


@pytest.mark.slow
def test_dtgpt_gives_muon_the_matrices_megatron_cores_builder_gives_it_on_mla_and_moe(mla_root):
    """megatron-core's get_megatron_muon_optimizer on its MLA + MoE model (tests/megatron_muon.py, in
    this launch) against dtgpt's build_optimizer on the same model: the same matrices take Muon (the
    latent attention's projections, none split as QKV; the router; the shared expert; the
    prediction module's), and each stacked expert weight is as many matrices as megatron-core's
    SequentialMLP has experts."""
    found = mla_root / "muon_params.json"
    if not found.exists():
        pytest.skip("megatron-core's Muon builder needs emerging-optimizers (make setup) and megatron-core 0.16.1")
    megatron = json.loads(found.read_text())
    with torch.device("meta"):
        model = GPT(model_cfg(), ROWS)
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = build_optimizer(model.named_parameters(), OptimizerConfig(optimizer="muon"), matrices=muon_matrices(model))
    muon = [p for g in optimizer.param_groups if g.get(MUON) for p in g["params"]]
    ours = {megatron_name(names[id(p)], mla=True, per_layer=True)[0]: p for p in muon}  # gate and fc1: linear_fc1
    assert sorted(ours) == sorted(set(megatron["muon"])) and megatron["qkv"] == []
    assert {name: ours[name].shape[0] for name in ours if ours[name].ndim == 3} == megatron["experts"]
    assert set(megatron["experts"].values()) == {EXPERTS} and "decoder.layers.1.mlp.router.weight" in ours
    assert "decoder.layers.1.self_attention.linear_kv_down_proj.weight" in ours


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


ADAM_RUN = [*(arg for arg in TRAIN_ON if not arg.startswith(("--optimizer.", "--training.train_iters="))),
            *(f"--optimizer.{key}={value}" for key, value in {**ADAM, **SCHEDULE}.items()),
            f"--training.train_iters={ITERATION + 1}", "--training.calculate_per_token_loss=false"]  # fmt: skip
"""train.py one iteration on from megatron-core's checkpoint with Adam state (tests/megatron_mla_adam.py),
with its optimizer, LR schedule and loss: Megatron-LM's default, the mean of micro-batch means, whose
MTP term divides each depth's token losses by that depth's own token count (T - 1 a sequence at
depth 1); dtgpt's default per-token loss divides them by the LM loss's (T), 3% less gradient here."""
ADAM_ON = {"adam_one": (1, [], "megatron_adam"), "adam_pp2": (*TRAINED_ON["pp2"], "megatron_adam"),
           "adam_tp2": (*TRAINED_ON["tp2"], "megatron_adam"), "adam_chained": (1, [], "megatron_adam_chained"),
           "adam_dp_reshardable": (1, [], "megatron_adam_dp_reshardable")}  # fmt: skip
"""run: (ranks, mesh, the checkpoint it resumes from); megatron_adam_chained: the chained
optimizers' tensors under the prefixes megatron-core gave them before chained_optim_avoid_prefix;
megatron_adam_dp_reshardable: the same state in Megatron-LM's default layout (flat buckets)."""
BUCKETS_READ = "optimizer state read from the distributed optimizer's dp_reshardable buckets (local layer order, SequentialMLP experts)"


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
    for name, (nproc, mesh, saved) in ADAM_ON.items():
        directories[name] = tmp_path_factory.mktemp(name)
        argv = run_args(directories[name], [*mesh, f"--checkpoint.load={mla_root / saved}"], name, ADAM_RUN, 0)
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
    """train.py resumed from megatron-core's weights-only checkpoint goes on from its iteration and
    consumed samples; its first loss and MTP loss are megatron-core's own on that global batch, and
    at tp 2 + SP and pp 2 the loss, MTP loss, gradient norm and router statistics of each iteration
    are one process's. Resumed from the checkpoint with Adam state (tests/megatron_mla_adam.py), it
    trains as one process does, every parameter after the step too (tests/parity_oracle.py). Not
    the weights-only runs' parameters (assert_same_figures): a tp 2 sum order moved one element of
    2560 by 4.3e-6 on one CPU (1.01e-5 of its tensor), not on another."""
    runs = {}
    for key in ("one", name, "adam_one", f"adam_{name}"):
        run = read_run(mla_on_dtgpt_meshes["directories"][key], key)
        runs[key] = {**run, "params": {i: run["params"][ITERATION + i] for i in range(1, STEPS + 1) if ITERATION + i in run["params"]}}
    for key in ("one", name):
        output = mla_on_dtgpt_meshes[key].checked()
        assert f"loaded Megatron checkpoint {mla_root / 'megatron'}/iter_{ITERATION:07d}: iteration {ITERATION}, consumed samples {CONSUMED}" in output
    one = runs["one"]
    assert one["iteration"] == [ITERATION + 1 + i for i in range(STEPS)] and one["consumed_samples"][0] == CONSUMED + 8
    theirs = torch.load(mla_root / "batch_losses.pt", weights_only=True)  # [LM loss, mtp_1 loss]
    assert one["loss"][0] == pytest.approx(theirs[0].item(), rel=1e-5)
    assert one["mtp_1 loss"][0] == pytest.approx(theirs[1].item(), rel=1e-5)
    assert_same_figures(runs[name], one, STEPS)
    mla_on_dtgpt_meshes[f"adam_{name}"].checked()
    assert_same_training(runs[f"adam_{name}"], runs["adam_one"], 1)


def megatron_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the torch_dist checkpoint under root (model and optimizer.state.*), whole,
    by its key under the local layer spec (Transformer Engine's fused norm names mapped back)."""
    directory = find(root)
    reader = FileSystemReader(str(directory))
    shapes = {k: m.size for k, m in reader.read_metadata().state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    tensors = {key: torch.empty(shape) for key, shape in shapes.items()}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    out = {}
    for key, value in tensors.items():
        slot = next((f"{OPTIMIZER_PREFIX}{s}." for s in ("exp_avg_sq", "exp_avg", "param") if key.startswith(f"{OPTIMIZER_PREFIX}{s}.")), "")
        name = key.removeprefix(slot)
        out[slot + (stored_alias(name) if name.endswith("layer_norm_weight") else name)] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ADAM_ON))
def test_megatron_mla_moe_mtp_adam_state_loads_and_steps_on_as_megatron_core(mla_root, mla_on_dtgpt_meshes, tmp_path, name):
    """megatron-core's distributed optimizer (dense and expert optimizers chained, dp 2 x ep 2)
    saves the MLA + MoE + MTP model with its Adam state, then takes its next step; train.py
    resumed from the saved checkpoint (one process; tp 2 + SP; pp 2, the MTP block and its copy of the
    embedding on the last stage; one process from the chained_<i>.-prefixed save, and from the
    dp_reshardable buckets of Megatron-LM's default layout) takes the same
    step: its LR from the checkpoint's schedule, the same LM loss, MTP loss and gradient norm, and
    after it the same weights, master weights, Adam moments and expert biases, tensor by tensor
    (to-megatron puts dtgpt's in megatron-core's keys)."""
    output = mla_on_dtgpt_meshes[name].checked()
    assert "optimizer state loaded: fp32 master weights (param), Adam moments, step 1" in output
    assert (BUCKETS_READ in output) == (name == "adam_dp_reshardable")
    saved = mla_root / ADAM_ON[name][2]
    assert f"loaded Megatron checkpoint {saved}/iter_{ITERATION:07d}: iteration {ITERATION}, consumed samples {CONSUMED}" in output
    directory = mla_on_dtgpt_meshes["directories"][name]
    run = read_run(directory, name)
    assert run["iteration"] == [ITERATION + 1] and run["consumed_samples"] == [CONSUMED + 8]
    groups = MegatronReader(find(mla_root / "megatron_adam")).common["optimizer"][0]["optimizer"]["param_groups"]  # every save's
    assert run["lr"][0] == pytest.approx(groups[0]["lr"], rel=1e-12)  # cosine decay at 48 samples: 5.5e-4
    loss, mtp_loss, grad_norm = torch.load(mla_root / "adam_step.pt", weights_only=True).tolist()
    assert run["loss"][0] == pytest.approx(loss, rel=1e-6) and run["mtp_1 loss"][0] == pytest.approx(mtp_loss, rel=1e-6)
    assert run["grad_norm"][0] == pytest.approx(grad_norm, rel=1e-5)
    assert load_script().main(["to-megatron", str(directory / f"{name}_ckpt"), str(tmp_path / "m")]) == 0
    ours, theirs = megatron_tensors(tmp_path / "m"), megatron_tensors(mla_root / "megatron_adam_stepped")
    assert ours.keys() == theirs.keys()
    model_keys = {k for k in theirs if not k.startswith(OPTIMIZER_PREFIX)}
    biases = {k for k in model_keys if k.endswith("router.expert_bias")}  # buffers, moved by the step
    assert len(biases) == 3 and {k.removeprefix(f"{OPTIMIZER_PREFIX}exp_avg.") for k in theirs if ".exp_avg." in k} == model_keys - biases
    for key, value in theirs.items():
        error = ((ours[key] - value).norm() / value.norm()).item()
        assert error <= 1e-5, (key, error)


BUCKETED = {"ep2": ("megatron_adam_dp_reshardable", "megatron_adam", 4 + 3 + 3, ("chained_1.optimizer.distributed.dp_group_idx_0",
                                                                                   "chained_1.optimizer.distributed.dp_group_idx_1")),
            "tp2": ("megatron_adam_tp2/dp_reshardable", "megatron_adam_tp2", 2, ("optimizer.distributed.dp_group_idx_0",
                                                                                 "optimizer.distributed.dp_group_idx_1")),
            "pp2": ("megatron_adam_pp2/dp_reshardable", "megatron_adam_pp2", 4, ("optimizer.distributed.dp_group_idx_1",))}  # fmt: skip
"""(dp_reshardable save, model-space save of the same state, buckets of its grad buffers, those
that hold the MTP block's experts) by layout (tests/megatron_mla_adam.py): dp 2 x ep 2 (the dense
buffer and each expert-parallel rank's, cut into buckets); tp 2 (dp 1, ep 1: the experts in each
tp rank's one bucket, split over expert tp 2); pp 2 (the embedding in a bucket of its own on the
first stage, and on the last its copy for the MTP block, never read)."""


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", list(BUCKETED))
def test_megatron_mla_moe_mtp_dp_reshardable_adam_state_reads_as_its_model_space_save(mla_root, layout_name):
    """Megatron-LM's default layout (dp_reshardable, without --dist-ckpt-optim-fully-reshardable)
    of the MLA + MoE + MTP model's Adam state: every tensor and every slot (master weights, both
    moments) reads bit for bit as megatron-core's model-space save of the same state (the local
    spec's MLA layer order; the MTP block between the decoder's final norm and the head; at ep 2
    the experts of the decoder's MoE layers and of the MTP block from each expert-parallel rank's
    own buffers, chained_1; at tp 2 each rank's shards of MLA's projections, rows, and eh_proj's;
    at pp 2 the MTP block's embedding copy on the last stage left unread)."""
    saved, model_space, bucket_count, mtp_buffers = BUCKETED[layout_name]
    shapes = full_model_shapes(model_cfg(), ROWS)
    buckets, gathered = (MegatronReader(find(mla_root / name)) for name in (saved, model_space))
    for reader in (buckets, gathered):
        reader.check(shapes, list(shapes))
    found, spec = buckets.bucket_layout()
    assert (spec, found.experts) == ("local", "SequentialMLP")
    assert sum(key.endswith(".param") and ".distributed." in key for key in buckets.shapes) == bucket_count
    mtp_experts = found.pieces[("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight", None)]
    assert {piece.prefix.split(".gbuf")[0] for piece in mtp_experts} == set(mtp_buffers)
    for slot in (None, "param", "exp_avg", "exp_avg_sq"):  # one read of every tensor a slot
        wanted = {name: (name, slot, (0,) * len(shape), shape) for name, shape in shapes.items() if slot is None or not is_buffer(name)}
        ours, theirs = buckets.regions(wanted), gathered.regions(wanted)
        for name in wanted:
            assert torch.equal(ours[name], theirs[name]), (name, slot)
