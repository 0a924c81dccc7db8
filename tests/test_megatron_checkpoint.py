"""Megatron-LM checkpoints in and out, with megatron-core's own GPTModel as the oracle.

megatron-core builds a 2-layer GPT on CPU at tp 1 (tied head), saves Megatron-LM's torch_dist
iteration and records its logits (fp32 and bf16) and its own loss; dtgpt loads it in one process
and must give the same logits and loss, or refuse a model that does not fit in one line. Megatron
pads the vocabulary to 16 x tp rows, dtgpt to make_vocab_size_divisible_by: a model loads a
checkpoint only with its rows, and only the 100 real tokens' logits are compared. The per-rank
format (tp 2, cut into pipeline stages) and the way out (to-megatron at tp 2, read by
megatron-core) are here too; megatron-core's tp 2 save trained on and its optimizer state:
tests/test_megatron_checkpoint_resume.py.

Each megatron-core run takes tens of seconds on a CPU: `make test-fast` keeps one round trip
(dtgpt -> Megatron tp 2 -> megatron-core's logits -> dtgpt) and the checks that run none; the
rest are marked slow (`make test` runs them).
"""

from __future__ import annotations

import argparse
import pickle
import shutil

import pytest
import torch

from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.export import load_model, read_config
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.formats import COMMON_ITEM, PER_RANK_FILE, is_torch_dist, load_pickle, per_rank_dirs, progress_of
from dtgpt.checkpoint.megatron.keys import full_model_shapes
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.checkpoint.safe import SafeReader
from tests.megatron_checkpoints import MEGATRON_RUN, ROWS, ROWS_TP2, assert_same_logits, imported_loss, model_cfg, write_stages
from tests.megatron_gpt import CONSUMED, CONSUMED_VALID, ITERATION, VOCAB, tokens
from tests.megatron_oracle import run_megatron_gpt
from tests.runs import run_train
from tests.test_checkpoint_convert import load_script


@pytest.fixture(scope="module")
def tp1_tied(tmp_path_factory):
    """Saved by megatron-core, with its fp32 logits and its bf16 (Float16Module) ones."""
    root = tmp_path_factory.mktemp("megatron_tp1")
    run_megatron_gpt("bf16", root, 1)
    return root


@pytest.mark.slow
def test_bf16_model_gives_megatron_float16module_logits(tp1_tied):
    """Megatron's bf16 regime is the whole model in bf16 (Float16Module); dtgpt's is FSDP's cast of
    every parameter (tests/test_precision.py: exactly the model cast to bf16). Same weights, same
    tokens: the two differ only by the order of bf16 roundings. Measured: 1.06 u relative, at most
    one bf16 ulp of the largest logit (1.19), while each is 1.3 u from the fp32 logits."""
    model = load_megatron_model(find(tp1_tied), model_cfg(), ROWS).eval().to(torch.bfloat16)
    with torch.no_grad():
        ours = model(tokens())[..., :VOCAB].float()
    theirs = torch.load(tp1_tied / "bf16_logits.pt", weights_only=True)[..., :VOCAB]
    u = 2.0**-8
    assert ((ours - theirs).norm() / theirs.norm()).item() < 2 * u
    ulp = 2.0 ** (torch.floor(torch.log2(theirs.abs().max())).item() - 7)
    assert (ours - theirs).abs().max().item() <= 2 * ulp


@pytest.mark.slow
def test_tp1_torch_dist_gives_megatron_logits(tp1_tied):
    directory = find(tp1_tied)
    assert directory == tp1_tied / f"iter_{ITERATION:07d}" and is_torch_dist(directory)
    assert_same_logits(tp1_tied, directory, model_cfg())


@pytest.mark.slow
def test_imported_loss_is_megatrons_own_or_the_load_is_refused(tp1_tied):
    """Every vocabulary row, padding included, is in the softmax: a model padded to other rows
    (128, zero rows added: exp(0) each) than the checkpoint's 112 would not give Megatron's loss,
    so it is refused in one line naming the key that gives the checkpoint's own rows."""
    theirs = torch.load(tp1_tied / "loss.pt", weights_only=True).item()
    assert abs(imported_loss(tp1_tied, 16) - theirs) <= 1e-6 * theirs
    with pytest.raises(CheckpointError) as e:
        imported_loss(tp1_tied, 64)
    assert str(e.value) == (
        f"Megatron checkpoint {find(tp1_tied)} pads the vocabulary to 112 rows (embedding.word_embeddings.weight (112, 64)) "
        "but this model has 128: every padding row is in the softmax, so other rows would change the loss; "
        "set model.make_vocab_size_divisible_by=16 to load it with its own padded vocabulary"
    )


@pytest.mark.slow
def test_a_megatron_checkpoint_without_common_pt_says_it_restarts_at_zero(tp1_tied, tmp_path, capsys):
    """Weights alone (no common.pt): they load, and one warning says the schedule starts over."""
    root = tmp_path / "weights_only"
    shutil.copytree(tp1_tied, root)
    common = find(root) / "common.pt"
    if common.is_file():
        common.unlink()
    else:  # megatron-core 0.19 keeps it as a bytes item of the DCP checkpoint: drop the item from the index
        index = find(root) / ".metadata"
        metadata = pickle.loads(index.read_bytes())
        del metadata.state_dict_metadata[COMMON_ITEM]
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != COMMON_ITEM}
        index.write_bytes(pickle.dumps(metadata))
    assert abs(imported_loss(root, 16) - torch.load(tp1_tied / "loss.pt", weights_only=True).item()) <= 1e-5
    assert "Megatron checkpoint: no common.pt (Megatron's iteration, sample counts, LR schedule and loss scale)" in capsys.readouterr().out


@pytest.mark.slow
def test_a_megatron_shard_with_overwritten_bytes_is_refused(tp1_tied, tmp_path):
    """Megatron's format has no checksums: bytes overwritten with NaNs load, and are caught as
    non-finite weights instead of training on (every iteration skipped)."""
    root = tmp_path / "damaged"
    shutil.copytree(tp1_tied, root)
    shard = max(find(root).glob("*.distcp"), key=lambda path: path.stat().st_size)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = b"\xff" * 4096  # float32 NaNs
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="holds non-finite weights"):
        imported_loss(root, 16)


@pytest.mark.slow
def test_a_rank_reads_only_the_stored_chunks_of_its_region(tp1_tied, monkeypatch):
    """What a pp2 x tp2 rank asks of a stacked tensor, layer 1's first half of rows, reads the
    one stored chunk of that layer (Megatron-LM stores each layer apart), not the stacked tensor."""
    bytes_read = []
    read_data = SafeReader.read_data

    def counting(self, plan, planner):
        bytes_read.extend(self.storage_data[item.storage_index].length for item in plan.items)
        return read_data(self, plan, planner)

    monkeypatch.setattr(SafeReader, "read_data", counting)
    reader = MegatronReader(find(tp1_tied))
    full = full_model_shapes(model_cfg(), ROWS)
    reader.check(full, list(full))
    stacked = reader.shapes["decoder.layers.mlp.linear_fc1.weight"]  # (2, 256, 64)
    layers = [reader.tensor(f"layers.{i}.mlp.fc1.weight", stacked[1:]) for i in range(2)]
    bytes_read.clear()
    half = reader.regions({"part": ("layers.1.mlp.fc1.weight", None, (0, 0), (128, 64))})["part"]
    assert torch.equal(half, layers[1][:128]) and not torch.equal(layers[0], layers[1])
    layer_bytes = 256 * 64 * 4
    assert len(bytes_read) == 1 and layer_bytes <= bytes_read[0] < 1.1 * layer_bytes  # a chunk: the layer and its header


@pytest.fixture(scope="module")
def tp1_args_free(tp1_tied, tmp_path_factory):
    """tp1_tied with common.pt's args holding no architecture (as older Megatron versions store
    fewer args): only the shapes can tell a model that does not fit."""
    root = tmp_path_factory.mktemp("megatron_args_free")
    directory = shutil.copytree(find(tp1_tied), root / f"iter_{ITERATION:07d}")
    common = MegatronReader(directory).common  # from common.pt, or megatron-core 0.19's DCP item
    common["args"] = argparse.Namespace(consumed_train_samples=CONSUMED, consumed_valid_samples=CONSUMED_VALID)
    torch.save(common, directory / "common.pt")
    return directory


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=32), "model.hidden_size: the checkpoint has 64 but the config has 32; set model.hidden_size=64, "
                               "or checkpoint.use_checkpoint_args=true to take the checkpoint's architecture"),
        (dict(ffn_hidden_size=128), "model.ffn_hidden_size: the checkpoint has 256 but the config has 128"),
        (dict(num_layers=3), "model.num_layers: the checkpoint has 2 but the config has 3"),
        (dict(untie_embeddings_and_output_weights=True), "model.untie_embeddings_and_output_weights: the checkpoint has false but the config has true"),
        (dict(position_embedding_type="rope"), "model.position_embedding_type: the checkpoint has 'learned_absolute' but the config has 'rope'"),
    ],
)  # fmt: skip
def test_an_architecture_other_than_the_args_names_the_key(tp1_tied, overrides, message):
    with pytest.raises(CheckpointError) as e:
        load_megatron_model(find(tp1_tied), model_cfg(**overrides), ROWS)
    assert str(e.value).startswith(f"Megatron checkpoint {find(tp1_tied)}: {message}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=32, num_attention_heads=4), "embedding.word_embeddings.weight has shape (112, 64) in the checkpoint but this model's embedding.word.weight needs (112, 32)"),
        (dict(ffn_hidden_size=128), "decoder.layers.mlp.linear_fc1.weight has shape (2, 256, 64) in the checkpoint but this model's layers.0.mlp.fc1.weight needs (128, 64)"),
        (dict(num_layers=3), "decoder.layers.self_attention.linear_qkv.weight stacks 2 layers (2, 192, 64) but model.num_layers=3"),
        (dict(untie_embeddings_and_output_weights=True), "has no output_layer.weight, which this model's output.weight (112, 64) needs"),
        (dict(position_embedding_type="rope"), "its tensor embedding.position_embeddings.weight (32, 64) has no counterpart in this model"),
    ],
)
def test_without_architecture_args_the_shapes_name_key_and_shapes(tp1_args_free, overrides, message):
    with pytest.raises(CheckpointError) as e:
        load_megatron_model(tp1_args_free, model_cfg(**overrides), ROWS)
    assert str(e.value).startswith(f"Megatron checkpoint {tp1_args_free}") and message in str(e.value)


@pytest.mark.slow
def test_train_py_refuses_a_megatron_checkpoint_of_another_shape_in_one_line(tp1_tied, tmp_path):
    proc = run_train(tmp_path, [*MEGATRON_RUN, "--model.untie_embeddings_and_output_weights=false", "--model.ffn_hidden_size=128",
                                f"--checkpoint.load={tp1_tied}"], check=False)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and "model.ffn_hidden_size: the checkpoint has 256 but the config has 128" in lines[0]


def test_loss_scale_is_found_where_megatron_optimizers_keep_it():
    scaler = {"scale": torch.tensor(1024.0), "growth_tracker": 3, "hysteresis_tracker": 2}
    for optimizer in ({"grad_scaler": scaler}, [{"grad_scaler": scaler, "optimizer": {}}]):
        assert progress_of({"iteration": 5, "optimizer": optimizer}) == {"iteration": 5, "loss_scale": scaler}


@pytest.mark.slow
def test_per_rank_format_tp2_gives_megatron_logits_at_any_pipeline_layout(tmp_path):
    """Megatron-LM's per-rank files of a 4-layer tp 2 model, as saved (pp 1), cut into pp 2, and
    into pp 2 with virtual pipelining (model0, model1: pp rank 0 holds layers 0 and 2, rank 1
    layers 1 and 3), all give megatron-core's logits; a file missing a chunk is one clear error."""
    run_megatron_gpt("per-rank", tmp_path, 2, "--untied", "--layers", "4")
    directory = find(tmp_path)
    assert sorted(per_rank_dirs(directory)) == [(0, 0, 0), (1, 0, 0)]
    assert not is_torch_dist(directory)
    cfg = model_cfg(untie_embeddings_and_output_weights=True, num_layers=4)
    assert_same_logits(tmp_path, directory, cfg, rows=ROWS_TP2)
    assert progress_of(MegatronReader(directory).common)["consumed_samples"] == CONSUMED
    for name, chunks in (("pp2", ["model"]), ("pp2_vpp2", ["model0", "model1"])):
        for tp in range(2):
            saved = load_pickle(directory / f"mp_rank_{tp:02d}" / PER_RANK_FILE)
            write_stages(saved, tmp_path / name, tp, 2, chunks, layers=4)
        assert sorted(per_rank_dirs(tmp_path / name)) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
        assert_same_logits(tmp_path, tmp_path / name, cfg, rows=ROWS_TP2)
        assert progress_of(MegatronReader(tmp_path / name).common)["iteration"] == ITERATION
    damaged = tmp_path / "pp2_vpp2" / "mp_rank_01_001" / PER_RANK_FILE
    torch.save({k: v for k, v in load_pickle(damaged).items() if k != "model1"}, damaged)
    with pytest.raises(CheckpointError, match=rf"{damaged} has no 'model1' \(rank 0's file has \['model0', 'model1'\]\)"):
        load_megatron_model(tmp_path / "pp2_vpp2", cfg, ROWS_TP2)


def test_dtgpt_checkpoint_converts_to_megatron_tp2_with_equal_logits(tmp_path):
    """dtgpt trains and saves; to-megatron writes torch_dist; megatron-core's GPTModel at tp 2
    loads it, and its two tied pipeline stages each load their file of to-megatron --format
    per-rank --pp 2 strictly, with dtgpt's logits. dtgpt pads to 32, so its 128 rows are Megatron's at tp 2 and the way back is exact."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "megatron"
    run_train(tmp_path, [*MEGATRON_RUN, "--model.untie_embeddings_and_output_weights=false", "--training.train_iters=2", "--optimizer.lr_warmup_iters=1",
                         "--eval.eval_interval=2", "--eval.eval_iters=3", "--model.make_vocab_size_divisible_by=32",
                         f"--checkpoint.save={ckpt}"])  # fmt: skip
    convert = load_script()
    assert convert.main(["to-megatron", str(ckpt), str(out), "--tp", "2"]) == 0
    directory = find(out)
    valid = 3 * 8  # one evaluation of 3 global batches of 8
    assert progress_of(MegatronReader(directory).common) == {"iteration": 2, "consumed_samples": 16, "consumed_valid_samples": valid, "lr_num_samples": 16}
    # and per-rank at pp 2: the last stage holds the head as output_layer.weight, its copy of the embedding
    assert convert.main(["to-megatron", str(ckpt), str(out / "per_rank_pp2"), "--format", "per-rank", "--pp", "2"]) == 0
    run_megatron_gpt("load", out, 2)  # megatron-core at tp 2, then its two tied stages (tests/megatron_tied_stages.py)
    cfg = read_config(layout.iteration_dir(ckpt, 2))
    model = load_model(layout.iteration_dir(ckpt, 2), cfg).eval()
    with torch.no_grad():
        ours = model(tokens())[..., :VOCAB]
    for name in ("loaded_logits.pt", "loaded_pp2_logits.pt"):
        theirs = torch.load(out / name, weights_only=True)[..., :VOCAB]
        assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5, name
    # and back: from-megatron gives the same weights again
    assert convert.main(["from-megatron", str(out), str(tmp_path / "back"), "--config", str(layout.iteration_dir(ckpt, 2) / "config.toml")]) == 0
    back = load_model(layout.iteration_dir(tmp_path / "back", 2), cfg)
    for (name, p), q in zip(model.named_parameters(), back.parameters()):
        assert torch.equal(p, q), name


