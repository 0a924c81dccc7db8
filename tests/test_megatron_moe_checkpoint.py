"""Megatron MoE checkpoints in and out, with megatron-core's own MoE GPTModel as the oracle.

One megatron-core launch on 2 gloo ranks at ep 2 (tests/megatron_moe_gpt.py): a 2-layer model of
MoE layers (4 SequentialMLP experts, top-2 of a sigmoid router with the expert bias, a SwiGLU
shared expert and its gate) saves torch_dist (the experts on their global axis) and the per-rank format
(mp_rank_00_000 and mp_rank_00_001, each with its 2 local_experts), and records its logits; in
the same launch it loads the checkpoints dtgpt wrote before it (to-megatron torch_dist and
per-rank at ep 2) into a model from another seed and records those logits. dtgpt must give the
same logits both ways. The same launch ends with megatron-core's distributed optimizer after one
step at ep 2 and at ep 1, saved dp_reshardable and in model space (tests/megatron_moe_adam.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dtgpt
from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.export import load_model, read_config
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.formats import is_torch_dist, per_rank_dirs, progress_of
from dtgpt.checkpoint.megatron.keys import full_model_shapes, is_buffer
from dtgpt.checkpoint.megatron.load import adam_step
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import ModelConfig
from tests.megatron_gpt import ITERATION, VOCAB, tokens
from tests.megatron_moe_gpt import EXPERT_FFN, EXPERTS, SHARED_FFN, TOPK
from tests.test_checkpoint_convert import load_script
from tests.test_megatron_family import ARCHS

ROWS = 112  # 100 padded to a multiple of 16, Megatron's at tp 1
SCRIPT = Path(__file__).with_name("megatron_moe_gpt.py")
WORKER = Path(__file__).with_name("megatron_family_worker.py")
MOE = dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=SHARED_FFN,
           moe_shared_expert_gate=True)  # fmt: skip
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0, attention_dropout=0.0,
             make_vocab_size_divisible_by=16, **ARCHS["llama"], **MOE)  # fmt: skip


def model_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{**MODEL, **overrides})


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours[..., :VOCAB], theirs[..., :VOCAB]
    return ((ours - theirs).norm() / theirs.norm()).item()


def save_dtgpt(root: Path, model: dict = MODEL) -> Path:
    """A dtgpt checkpoint of the MoE model (`model`: [model]) at its seeded init, with router
    weights, expert biases and norms drawn wide (routing then depends on them; a mix-up of any would show)."""
    cfg = dtgpt.make_config(model=model, data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB),
                            training=dict(micro_batch_size=2, global_batch_size=2))  # fmt: skip
    runtime = dtgpt.init_distributed(cfg)
    built = dtgpt.build_model(cfg, runtime, VOCAB)
    draw = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, value in built.parts[0].state_dict(keep_vars=True).items():
            if "router" in name:
                value.copy_(torch.randn(value.shape, generator=draw))
            elif "norm" in name:
                value.uniform_(0.5, 1.5, generator=draw)
    return dtgpt.save_checkpoint(root, cfg, runtime, built, iteration=3)


def launch(script: Path, root: Path) -> None:
    """megatron-core's script on 2 gloo ranks, asserting it ran through."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(root)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory) -> Path:
    """dtgpt's checkpoint and its to-megatron conversion, then megatron-core's launch at ep 2."""
    root = tmp_path_factory.mktemp("megatron_moe")
    save_dtgpt(root / "dtgpt")
    convert = load_script()
    assert convert.main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt")]) == 0
    per_rank = ["--format", "per-rank", "--ep", "2"]
    assert convert.main(["to-megatron", str(root / "dtgpt"), str(root / "from_dtgpt_per_rank"), *per_rank]) == 0
    launch(SCRIPT, root)
    return root


@pytest.mark.slow
def test_megatron_moe_torch_dist_at_ep2_gives_megatrons_logits(moe_root):
    directory = find(moe_root / "megatron")
    assert is_torch_dist(directory)
    reader = MegatronReader(directory)
    # the experts on torch_dist's global expert axis, after the layer axis
    assert reader.shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, EXPERTS, 2 * EXPERT_FFN, 64)
    assert reader.shapes["decoder.layers.mlp.router.expert_bias"] == (2, EXPERTS)
    assert reader.shapes["decoder.layers.mlp.shared_experts.gate_weight"] == (2, 1, 64)  # Megatron's gate, one row
    model = load_megatron_model(directory, model_cfg(), ROWS).eval()
    assert model.layers["0"].mlp.router.expert_bias.abs().min() > 0  # Megatron's drawn bias, not the zero init
    with torch.no_grad():
        assert relative_error(model(tokens()), torch.load(moe_root / "logits.pt", weights_only=True)) < 1e-5


@pytest.mark.slow
def test_megatron_moe_per_rank_files_at_ep2_give_megatrons_logits(moe_root):
    directory = find(moe_root / "megatron_per_rank")
    # Megatron-LM names ep ranks with a lone 3-digit suffix when pp is 1: (tp, pp, ep)
    assert sorted(per_rank_dirs(directory, expert_parallel=True)) == [(0, 0, 0), (0, 0, 1)]
    assert progress_of(MegatronReader(directory).common)["iteration"] == ITERATION
    model = load_megatron_model(directory, model_cfg(), ROWS).eval()
    with torch.no_grad():
        assert relative_error(model(tokens()), torch.load(moe_root / "logits.pt", weights_only=True)) < 1e-5


@pytest.mark.slow
def test_dtgpt_moe_checkpoint_to_megatron_loads_in_megatron_core_at_ep2_with_equal_logits(moe_root, tmp_path):
    saved = layout.iteration_dir(moe_root / "dtgpt", 3)
    model = load_model(saved, read_config(saved)).eval()
    with torch.no_grad():
        ours = model(tokens())
    assert relative_error(ours, torch.load(moe_root / "loaded_logits.pt", weights_only=True)) < 1e-5
    assert_converts_back(moe_root / "from_dtgpt", saved, tmp_path / "back")  # the expert bias included


def assert_converts_back(megatron: Path, saved: Path, out: Path) -> None:
    """from-megatron of `megatron` (to-megatron's output of dtgpt iteration `saved`) gives every tensor again."""
    assert load_script().main(["from-megatron", str(megatron), str(out), "--config", str(saved / "config.toml")]) == 0
    ours = load_model(saved, read_config(saved)).state_dict()
    back = load_model(layout.iteration_dir(out, 3), read_config(saved)).state_dict()
    assert ours.keys() == back.keys()
    for name, value in ours.items():
        assert torch.equal(value, back[name]), name


@pytest.mark.slow
def test_dtgpt_moe_per_rank_files_at_ep2_load_in_megatron_core_with_equal_logits(moe_root):
    """to-megatron --format per-rank --ep 2: megatron-core's ranks each load their own file
    strictly (every key, _extra_state included) and give dtgpt's logits; dtgpt reads them back."""
    saved = layout.iteration_dir(moe_root / "dtgpt", 3)
    model = load_model(saved, read_config(saved)).eval()
    with torch.no_grad():
        ours = model(tokens())
    assert relative_error(ours, torch.load(moe_root / "loaded_per_rank_logits.pt", weights_only=True)) < 1e-5
    directory = find(moe_root / "from_dtgpt_per_rank")
    assert sorted(p.name for p in directory.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    with torch.no_grad():
        assert relative_error(load_megatron_model(directory, model_cfg(), ROWS).eval()(tokens()), ours) < 1e-6


@pytest.mark.slow
def test_megatron_moe_checkpoints_load_into_dtgpt_at_ep2_pp2_and_tp2(moe_root, adam_tp2pp2):
    """checkpoint.load of Megatron's MoE checkpoints at dtgpt meshes (tests/megatron_family_worker.py):
    the experts split over ep 2 (each rank reads only its experts' region), pp 2, and tp 2 with
    sequence parallelism (the experts, router and expert bias split as dtgpt's tp plan splits them);
    and the dp_reshardable Adam state saved at ep 2 loads at ep 2, the one saved at tp 2 with
    expert tp 2 and ep 2 (tests/test_megatron_moe_tp2_adam.py) at ep 2 and at tp 2, the one saved at
    pp 2 with virtual stages and ep 2 at ep 2 and pp 2, and the one saved at tp 2 x pp 2 with expert
    tp 1 and ep 2 at tp 2, its weights the buckets' masters."""
    import json

    fields = {k: v for k, v in MODEL.items() if k not in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                                             "hidden_dropout", "attention_dropout")}  # fmt: skip
    adam = moe_root / "adam_ep2" / "dp_reshardable"  # its weights from the buckets' masters, each rank its experts' pieces
    adam_tp2 = adam_tp2pp2 / "moe_tp2" / "etp2_ep2"
    adam_vp, adam_pp2 = adam_tp2pp2 / "moe_vp" / "etp1_ep2", adam_tp2pp2 / "moe_tp2pp2" / "etp1_ep2"
    jobs = [[str(moe_root / "megatron"), fields, ["ep2", "pp2", "tp2"]], [str(moe_root / "megatron_per_rank"), fields, ["ep2"]],
            [str(adam), fields, ["ep2"]], [str(adam_tp2 / "dp_reshardable"), {**fields, "make_vocab_size_divisible_by": 32}, ["ep2", "tp2"]],
            [str(adam_vp / "dp_reshardable"), {**fields, "num_layers": 4}, ["ep2", "pp2"]],
            [str(adam_pp2 / "dp_reshardable"), {**fields, "make_vocab_size_divisible_by": 32}, ["tp2"]]]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), json.dumps(jobs)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    # one line per load of the buckets: at ep 2, the tp 2 save's at ep 2 and tp 2, the virtual stages' at ep 2 and pp 2, tp 2 x pp 2's at tp 2
    assert proc.stdout.count("optimizer state read from the distributed optimizer's dp_reshardable buckets (local layer order, SequentialMLP experts)") == 6
    theirs = torch.load(moe_root / "logits.pt", weights_only=True)
    for root, layouts in (("megatron", ("ep2", "pp2", "tp2")), ("megatron_per_rank", ("ep2",))):
        for name in layouts:
            assert relative_error(torch.load(moe_root / root / f"{name}_logits.pt", weights_only=True), theirs) < 1e-5, (root, name)
    with torch.no_grad():  # the stepped model, as megatron-core's model-space save of it holds it
        stepped = load_megatron_model(find(moe_root / "adam_ep2"), model_cfg(), ROWS).eval()(tokens())
    assert relative_error(torch.load(adam / "ep2_logits.pt", weights_only=True), stepped) < 1e-5
    assert relative_error(stepped, theirs) > 1e-2  # another model than the unstepped one
    with torch.no_grad():
        stepped_tp2 = load_megatron_model(find(adam_tp2), model_cfg(make_vocab_size_divisible_by=32), 128).eval()(tokens())
    for name in ("ep2", "tp2"):
        assert relative_error(torch.load(adam_tp2 / "dp_reshardable" / f"{name}_logits.pt", weights_only=True), stepped_tp2) < 1e-5, name
    with torch.no_grad():  # saved at pp 2: each dtgpt rank its layers', or its experts', pieces of the chunks' buffers
        stepped_vp = load_megatron_model(find(adam_vp), model_cfg(num_layers=4), ROWS).eval()(tokens())
        stepped_pp2 = load_megatron_model(find(adam_pp2), model_cfg(make_vocab_size_divisible_by=32), 128).eval()(tokens())
    for name in ("ep2", "pp2"):
        assert relative_error(torch.load(adam_vp / "dp_reshardable" / f"{name}_logits.pt", weights_only=True), stepped_vp) < 1e-5, name
    assert relative_error(torch.load(adam_pp2 / "dp_reshardable" / "tp2_logits.pt", weights_only=True), stepped_pp2) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("overrides, key", [
    (dict(moe_router_topk=1), "model.moe_router_topk: the checkpoint has 2 but the config has 1"),
    (dict(num_experts=None, moe_router_enable_expert_bias=False), "model.num_experts: the checkpoint has 4 but the config has unset"),
    (dict(moe_shared_expert_intermediate_size=None), "model.moe_shared_expert_intermediate_size: the checkpoint has 48"),
    (dict(moe_ffn_hidden_size=None), "model.moe_ffn_hidden_size: the checkpoint has 32 but the config has 128"),
])  # fmt: skip
def test_a_moe_architecture_other_than_megatrons_args_is_one_error(moe_root, overrides, key):
    for name in ("megatron", "megatron_per_rank"):
        with pytest.raises(CheckpointError, match=key):
            load_megatron_model(find(moe_root / name), model_cfg(**overrides), ROWS)


@pytest.fixture(scope="module")
def dtgpt_moe(tmp_path_factory) -> Path:
    """dtgpt's MoE checkpoint alone (no megatron-core launch)."""
    root = tmp_path_factory.mktemp("dtgpt_moe")
    save_dtgpt(root)
    return root


def test_per_rank_files_at_tp2_ep2_hold_each_ranks_slice_and_read_back_whole(dtgpt_moe, tmp_path):
    """Megatron-LM's names (mp_rank_TT_EEE), each ep rank's two experts numbered from 0 and split
    over tp; dtgpt glues every tensor back whole."""
    assert load_script().main(["to-megatron", str(dtgpt_moe), str(tmp_path), "--format", "per-rank", "--tp", "2", "--ep", "2"]) == 0
    directory = find(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    saved = layout.iteration_dir(dtgpt_moe, 3)
    ours = load_model(saved, read_config(saved)).state_dict()
    second = torch.load(directory / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    # ep rank 1's local expert 0 is global expert 2; tp rank 1 holds the second half of its fc2 columns
    fc2 = second["model"]["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(fc2, ours["layers.1.mlp.experts.fc2_weight"][2][:, EXPERT_FFN // 2:])
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in second["model"]
    assert second["args"].expert_model_parallel_size == 2 and second["args"].num_experts == EXPERTS
    assert second["args"].expert_tensor_parallel_size == 2  # the experts split over tp, as written
    back = load_megatron_model(directory, model_cfg(make_vocab_size_divisible_by=32), 128).state_dict()
    for name, value in ours.items():
        stored = back[name][: value.shape[0]] if name in ("embedding.word.weight", "output.weight") else back[name]
        assert torch.equal(stored, value), name


@pytest.mark.parametrize("flags, message", [
    (["--format", "per-rank", "--ep", "3"], "--ep 3: the expert-parallel ranks must split model.num_experts=4 evenly"),
    (["--ep", "2"], "--ep names the per-rank format's expert-parallel files"),
])  # fmt: skip
def test_to_megatron_refuses_an_expert_split_in_one_line(dtgpt_moe, tmp_path, capfd, flags, message):
    assert load_script().main(["to-megatron", str(dtgpt_moe), str(tmp_path / "out"), *flags]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


@pytest.mark.parametrize("etp", [1, 4])
def test_per_rank_files_saved_with_another_expert_tp_split_are_one_error_line(dtgpt_moe, tmp_path, capfd, etp):
    """Megatron's --expert-tensor-parallel-size other than tp slices (or, at 1, keeps whole) the
    experts in each file otherwise than the dense MLP: the reader refuses before reading a tensor."""
    assert load_script().main(["to-megatron", str(dtgpt_moe), str(tmp_path / "m"), "--format", "per-rank", "--tp", "2"]) == 0
    directory = find(tmp_path / "m")
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = directory / rank / "model_optim_rng.pt"
        saved = torch.load(path, weights_only=False)
        saved["args"].expert_tensor_parallel_size = etp
        torch.save(saved, path)
    config = layout.iteration_dir(dtgpt_moe, 3) / layout.CONFIG
    capfd.readouterr()
    assert load_script().main(["from-megatron", str(directory), str(tmp_path / "out"), "--config", str(config)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert f"its args say expert_tensor_parallel_size={etp} with tensor_model_parallel_size=2" in err[0]
    assert "takes experts split over tp as the dense MLP" in err[0] and "torch_dist" in err[0]


def test_per_rank_files_of_a_model_mixing_dense_and_moe_layers_read_back_whole(tmp_path):
    """moe_layer_freq=2 (layer 0 MoE, layer 1 dense): each file keeps its layers' own tensors, and
    dtgpt reads the layers apart (as torch_dist keeps them; megatron-core's own files of such a
    model: tests/test_megatron_mla_checkpoint.py)."""
    saved = save_dtgpt(tmp_path / "dtgpt", {**MODEL, "moe_layer_freq": 2, "make_vocab_size_divisible_by": 32})  # tp 2 pads to 128 rows too
    flags = ["--format", "per-rank", "--tp", "2", "--ep", "2"]
    assert load_script().main(["to-megatron", str(tmp_path / "dtgpt"), str(tmp_path / "m"), *flags]) == 0
    model = torch.load(find(tmp_path / "m") / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)["model"]
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in model
    assert model["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 128 // 2, 64)  # [gate; fc1], tp rank 1's rows
    assert MegatronReader(find(tmp_path / "m")).shapes["decoder.layers.1.mlp.linear_fc1.weight"] == (256, 64)
    assert_converts_back(tmp_path / "m", saved, tmp_path / "back")


def test_moe_architecture_keys_are_compared_with_megatrons_args():
    """The MoE args Megatron-LM keeps (validate_args fills moe_ffn_hidden_size in from
    ffn_hidden_size) against [model]; a dense checkpoint's num_experts None against a MoE config."""
    import argparse

    from dtgpt.checkpoint.architecture import difference, megatron_architecture, megatron_args, with_megatron_architecture

    cfg = model_cfg()
    args = argparse.Namespace(**megatron_args(cfg))
    assert difference(megatron_architecture(args), cfg) is None
    assert "model.moe_ffn_hidden_size: the checkpoint has 128" in difference(
        megatron_architecture(argparse.Namespace(**{**vars(args), "moe_ffn_hidden_size": None})), cfg)
    dense = argparse.Namespace(**megatron_args(model_cfg(num_experts=None, moe_router_enable_expert_bias=False)))
    assert "model.num_experts: the checkpoint has unset but the config has 4; set no model.num_experts" in difference(
        megatron_architecture(dense), cfg)
    unshared = argparse.Namespace(**{**vars(args), "moe_shared_expert_intermediate_size": None})
    assert "model.moe_shared_expert_intermediate_size: the checkpoint has unset but the config has 48" in difference(
        megatron_architecture(unshared), cfg)
    assert with_megatron_architecture(dense, cfg).num_experts is None


def test_per_rank_files_at_tp2_pp2_ep2_of_a_tied_model_read_back_whole(tmp_path):
    """Megatron-LM's names with all three suffixes (mp_rank_TT_PPP_EEE), each stage's layer
    numbered 0, the embedding on the first stage and, tied at pp > 1, the last stage's copy of it
    as output_layer.weight; dtgpt glues every tensor back whole."""
    tied = {**MODEL, "untie_embeddings_and_output_weights": False}
    save_dtgpt(tmp_path / "d", tied)
    flags = ["--format", "per-rank", "--tp", "2", "--pp", "2", "--ep", "2"]
    assert load_script().main(["to-megatron", str(tmp_path / "d"), str(tmp_path / "m"), *flags]) == 0
    directory = find(tmp_path / "m")
    assert sorted(p.name for p in directory.iterdir()) == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    first, last = (torch.load(directory / f"mp_rank_01_{p:03d}_001" / "model_optim_rng.pt", weights_only=False) for p in range(2))
    assert "embedding.word_embeddings.weight" in first["model"] and "output_layer.weight" not in first["model"]
    assert torch.equal(last["model"]["output_layer.weight"], first["model"]["embedding.word_embeddings.weight"])
    assert "decoder.final_layernorm.weight" in last["model"] and "embedding.word_embeddings.weight" not in last["model"]
    assert {k.split(".")[2] for k in last["model"] if k.startswith("decoder.layers.")} == {"0"}
    assert last["args"].pipeline_model_parallel_size == 2
    saved = layout.iteration_dir(tmp_path / "d", 3)
    ours = load_model(saved, read_config(saved)).state_dict()
    back = load_megatron_model(directory, model_cfg(untie_embeddings_and_output_weights=False, make_vocab_size_divisible_by=32), 128)
    for name, value in ours.items():
        stored = back.state_dict()[name]
        assert torch.equal(stored[: value.shape[0]] if name in ("embedding.word.weight", "output.weight") else stored, value), name


# -- the distributed optimizer's Adam state (tests/megatron_moe_adam.py, in moe_root's launch) --

ADAM_EPS = (2, 1)
"""The expert parallelism megatron-core saved its Adam state at: 2 (the experts' own optimizer,
chained_1, one expert-parallel rank's buffers each) and 1 (the experts in the dense buffer)."""


@pytest.mark.slow
@pytest.mark.parametrize("ep", ADAM_EPS)
def test_megatron_moe_dp_reshardable_adam_state_reads_as_megatron_gathers_it(moe_root, ep):
    """The dp_reshardable buckets of an MoE model (saved on 2 ranks: dense dp 2, the experts at
    ep 2 or 1) read, tensor by tensor and slot by slot, bit for bit as megatron-core's own
    model-space save of the same state: router, shared expert and the rest from the dense
    buffers, each routed expert from its own expert-parallel rank's buffers (chained_1) at ep 2."""
    shapes = full_model_shapes(model_cfg(), ROWS)
    buckets = MegatronReader(layout.iteration_dir(moe_root / f"adam_ep{ep}" / "dp_reshardable", ITERATION))
    gathered = MegatronReader(layout.iteration_dir(moe_root / f"adam_ep{ep}", ITERATION))
    for reader in (buckets, gathered):
        reader.check(shapes, list(shapes))
    found, spec = buckets.bucket_layout()
    assert spec == "local" and found.experts == "SequentialMLP" and gathered.bucket_layout()[0] is None
    expert_buffers = {piece.prefix.split(".gbuf")[0] for piece in found.pieces[("decoder.layers.mlp.experts.experts.linear_fc1.weight", 1)]}
    assert expert_buffers == ({f"chained_1.optimizer.distributed.dp_group_idx_{m}" for m in range(2)} if ep == 2 else
                              {"optimizer.distributed.dp_group_idx_0"})  # fmt: skip
    assert adam_step(buckets.optimizer_common()) == 1.0
    for name, shape in shapes.items():
        for slot in ("param", "exp_avg", "exp_avg_sq") if not is_buffer(name) else ():
            assert torch.equal(buckets.tensor(name, shape, slot), gathered.tensor(name, shape, slot)), (name, slot, ep)


@pytest.mark.slow
def test_megatron_moe_dp_reshardable_adam_state_steps_on_as_its_model_space_save(moe_root, capsys):
    """One dtgpt step (AdamW, clipped) from the dp_reshardable buckets saved at ep 2 equals one
    from megatron-core's model-space save of the same state: weights and both moments, bit for
    bit; the log says where the state came from."""
    assert_steps_on_alike(moe_root / "adam_ep2", MODEL, capsys)


def assert_steps_on_alike(saved: Path, model: dict, capsys) -> None:
    """One dtgpt step of `model` ([model]) from saved/dp_reshardable's buckets and one from
    megatron-core's model-space save under `saved` give the same weights and moments, bit for bit."""
    from dtgpt.checkpoint.megatron.keys import dtgpt_names

    stepped = {}
    for source in ("dp_reshardable", "model_space"):
        cfg = dtgpt.make_config(model=model, data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB),
                                training=dict(micro_batch_size=2, global_batch_size=2),
                                optimizer=dict(lr_decay_style="constant", lr_warmup_iters=0, lr=1e-3, clip_grad=1.0))  # fmt: skip
        runtime = dtgpt.init_distributed(cfg)
        state = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, VOCAB))
        root = saved / ("dp_reshardable" if source == "dp_reshardable" else "")
        assert dtgpt.load_checkpoint(root, cfg, runtime, state) == ITERATION
        log = capsys.readouterr().out
        assert "optimizer state loaded: fp32 master weights (param), Adam moments, step 1" in log, log
        assert ("dp_reshardable buckets (local layer order, SequentialMLP experts)" in log) == (source == "dp_reshardable")
        dtgpt.train_step(cfg, state, tokens())
        optimizer = state.optimizer.optimizers[0]
        params = dict(state.model.parts[0].named_parameters())
        stepped[source] = {name: (params[name].detach().clone(), *(optimizer.state[params[name]][k].clone() for k in ("exp_avg", "exp_avg_sq")))
                           for name in dtgpt_names(cfg.model) if name in params}  # fmt: skip
    assert stepped["dp_reshardable"].keys() == stepped["model_space"].keys() == {n for n in dtgpt_names(cfg.model) if not is_buffer(n)}
    for name, values in stepped["dp_reshardable"].items():
        for ours, theirs in zip(values, stepped["model_space"][name]):
            assert torch.equal(ours, theirs), name
