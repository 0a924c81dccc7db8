"""Megatron-LM checkpoints in and out, with megatron-core's own GPTModel as the oracle.

megatron-core builds a 2-layer GPT on CPU at tp 1 (tied head) and tp 2 (untied, on 2 gloo ranks),
saves Megatron-LM's torch_dist iteration (or the per-rank format) and records its logits and its
own loss; dtgpt loads it (one process, and training on at pp2) and must give the same logits and
loss. Megatron pads the vocabulary to 16 x tp rows, dtgpt to make_vocab_size_divisible_by: a model
loads a checkpoint only with its rows (tp 2: divisible by 32), and only the 100 real tokens'
logits are compared.

Each megatron-core run takes tens of seconds on a CPU: `make test-fast` keeps one round trip
(dtgpt -> Megatron tp 2 -> megatron-core's logits -> dtgpt) and the checks that run none; the
rest are marked slow (`make test` runs them).
"""

from __future__ import annotations

import argparse
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from dtgpt.api import build_model, build_train_state, forward_backward, init_distributed, load_checkpoint, make_config
from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.distrib_optim import Unmapped, bucket_lengths, candidate_cuts
from dtgpt.checkpoint.megatron.formats import COMMON_ITEM, PER_RANK_FILE, is_torch_dist, load_pickle, per_rank_dirs, progress_of
from dtgpt.checkpoint.megatron.keys import full_model_shapes, megatron_name
from dtgpt.checkpoint.megatron.per_rank_optim import file_state, parameters
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.checkpoint.export import load_model, read_config, read_sections
from dtgpt.checkpoint.safe import SafeReader
from dtgpt.config import ModelConfig
from dtgpt.data.batch import Batch
from tests.megatron_adam import ADAM, BUCKET_SIZE, SHIFTED
from tests.megatron_gpt import CONSUMED, CONSUMED_VALID, HEADS, ITERATION, LR_SAMPLES, PARALLEL_ADAM, SEQ, VOCAB, labels, tokens
from tests.megatron_oracle import run_megatron_gpt
from tests.runs import TINY, Command, launch_commands, read_metrics, run_train, selected_cases
from tests.test_checkpoint_convert import load_script
from tests.test_megatron_family import model_cfg as family_cfg

ROWS = 112  # the padded vocabulary: 100 -> a multiple of 16 (Megatron at tp 1, dtgpt)
ROWS_TP2 = 128  # Megatron at tp 2: a multiple of 32


def model_cfg(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                  attention_dropout=0.0, make_vocab_size_divisible_by=16)  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def assert_same_logits(root, directory, cfg: ModelConfig, name: str = "logits.pt", rows: int = ROWS) -> None:
    model = load_megatron_model(directory, cfg, rows).eval()
    with torch.no_grad():
        ours = model(tokens())[..., :VOCAB]
    theirs = torch.load(root / name, weights_only=True)[..., :VOCAB]
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5


@pytest.fixture(scope="module")
def tp1_tied(tmp_path_factory):
    """Saved by megatron-core, with its fp32 logits and its bf16 (Float16Module) ones."""
    root = tmp_path_factory.mktemp("megatron_tp1")
    run_megatron_gpt("bf16", root, 1)
    return root


@pytest.fixture(scope="module")
def tp2_untied(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_tp2")
    run_megatron_gpt("save", root, 2, "--untied")
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


def imported_loss(root, divisible_by: int) -> float:
    """dtgpt's loss of tokens() -> labels() (the library's forward) after loading the Megatron
    checkpoint under root into a model padded to a multiple of `divisible_by`."""
    cfg = make_config(
        model=dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
                   attention_dropout=0.0, make_vocab_size_divisible_by=divisible_by),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        training=dict(micro_batch_size=2, global_batch_size=2),
    )  # fmt: skip
    runtime = init_distributed(cfg)
    state = build_train_state(cfg, build_model(cfg, runtime, VOCAB))
    load_checkpoint(root, cfg, runtime, state)
    return forward_backward(state.model, Batch(tokens(), labels()), 1, forward_only=True)


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


@pytest.mark.slow
def test_tp2_untied_torch_dist_gives_megatron_logits(tp2_untied):
    directory = find(tp2_untied)
    assert MegatronReader(directory).shapes["embedding.word_embeddings.weight"] == (ROWS_TP2, 64)  # 16 x tp 2
    assert_same_logits(tp2_untied, directory, model_cfg(untie_embeddings_and_output_weights=True), rows=ROWS_TP2)


def test_loss_scale_is_found_where_megatron_optimizers_keep_it():
    scaler = {"scale": torch.tensor(1024.0), "growth_tracker": 3, "hysteresis_tracker": 2}
    for optimizer in ({"grad_scaler": scaler}, [{"grad_scaler": scaler, "optimizer": {}}]):
        assert progress_of({"iteration": 5, "optimizer": optimizer}) == {"iteration": 5, "loss_scale": scaler}


@pytest.mark.slow
def test_trainer_state_is_read(tp2_untied):
    common = MegatronReader(find(tp2_untied)).common
    assert progress_of(common) == {"iteration": ITERATION, "consumed_samples": CONSUMED, "consumed_valid_samples": CONSUMED_VALID,
                                   "lr_num_samples": LR_SAMPLES}


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
def test_an_untied_checkpoint_into_a_tied_model_is_refused(tp2_untied):
    with pytest.raises(CheckpointError, match="model.untie_embeddings_and_output_weights: the checkpoint has true but the config has false"):
        load_megatron_model(find(tp2_untied), model_cfg(), ROWS_TP2)


def write_stages(saved: dict, out, tp: int, pp: int, chunks: list[str], layers: int, counts: list[int] | None = None) -> None:
    """One tp rank's whole per-rank model (`saved`, layers numbered 0..layers-1) as Megatron-LM
    saves it cut into pp ranks, each holding `chunks` (["model"], or with virtual pipelining
    ["model0", "model1", ...]; chunk v of pp rank r is stage v * pp + r), layers numbered within
    their chunk (`counts` per stage, else even), the embedding on the first stage, the final norm,
    head and multi-token prediction modules on the last."""
    stages = pp * len(chunks)
    counts = counts or [layers // stages] * stages
    first = [sum(counts[:stage]) for stage in range(stages)]
    files = [{**{k: v for k, v in saved.items() if k != "model"}, **{c: {} for c in chunks}} for _ in range(pp)]
    for key, value in saved["model"].items():
        if key.startswith("decoder.layers."):
            layer, rest = key[len("decoder.layers."):].split(".", 1)
            stage = max(s for s in range(stages) if first[s] <= int(layer))
            key = f"decoder.layers.{int(layer) - first[stage]}.{rest}"
        else:
            stage = stages - 1 if key.startswith(("decoder.final", "output_layer", "mtp.")) else 0
        files[stage % pp][chunks[stage // pp]][key] = value
    for r, content in enumerate(files):
        (out / f"mp_rank_{tp:02d}_{r:03d}").mkdir(parents=True, exist_ok=True)
        torch.save(content, out / f"mp_rank_{tp:02d}_{r:03d}" / PER_RANK_FILE)


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


MEGATRON_RUN = [
    *TINY, "--model.num_layers=2", "--model.make_vocab_size_divisible_by=16", "--data.vocab_size=100",
    "--model.untie_embeddings_and_output_weights=true", f"--training.train_iters={ITERATION + 5}",
    "--logging.log_interval=1",
]  # fmt: skip


PP2_FROM_TP2 = (("one", 1, []), ("pp2", 2, ["--parallel.pipeline_model_parallel_size=2"]))


@pytest.fixture(scope="module")
def trained_on(request, tmp_path_factory) -> dict:
    """train.py's runs from megatron-core's checkpoints that the selected tests read, launched
    together: one launch per rank count (tests/runs.py launch_commands). {key: (Finished, its directory)}."""
    commands = []

    def add(key: str, nproc: int, args: list[str], save: bool = False) -> None:
        directory = tmp_path_factory.mktemp(key)
        saves = [f"--checkpoint.save={directory}/ckpt"] if save else []
        commands.append(Command(key, directory, [*args, *saves, f"--logging.metrics_file={directory}/m.jsonl"], nproc))

    if selected_cases(request, test_megatron_tp2_checkpoint_trains_on_at_pp2):
        tp2_untied = request.getfixturevalue("tp2_untied")
        for name, nproc, mesh in PP2_FROM_TP2:
            add(f"tp2_{name}", nproc, [*MEGATRON_RUN, "--model.make_vocab_size_divisible_by=32", *mesh, f"--checkpoint.load={tp2_untied}"])
    if selected_cases(request, test_megatron_adam_state_loads_and_steps_on_like_megatron):
        for name, nproc, iters, mesh, source in ADAM_LAYOUTS:
            add(f"adam_{name}", nproc, [*ADAM_RUN, *mesh, f"--training.train_iters={iters}", f"--checkpoint.load={adam_source(request, source)}"], save=True)
    if selected_cases(request, test_load_optimizer_false_leaves_adam_fresh):
        adam_tp1 = request.getfixturevalue("adam_tp1")
        add("adam_fresh", 1, [*ADAM_RUN, f"--checkpoint.load={adam_tp1}", "--checkpoint.load_optimizer=false",
                                "--training.train_iters=" + str(ITERATION + 1)], save=True)  # fmt: skip
    if selected_cases(request, test_shifted_model_space_adam_state_is_not_taken):
        adam_tp1 = request.getfixturevalue("adam_tp1")
        add("adam_shifted", 1, [*ADAM_RUN, f"--checkpoint.load={adam_tp1 / SHIFTED}", f"--training.train_iters={ITERATION + 1}"], save=True)
    finished = launch_commands(sorted(commands, key=lambda c: c.nproc))
    return {c.key: (finished[c.key], c.directory) for c in commands}


def trained(trained_on: dict, key: str) -> tuple[str, Path]:
    """(output, directory) of a run that finished; one that failed fails the test with its log."""
    finished, directory = trained_on[key]
    return finished.checked(), directory


@pytest.mark.slow
def test_megatron_tp2_checkpoint_trains_on_at_pp2(tp2_untied, trained_on):
    """Iteration and consumed samples come from Megatron's common.pt; pp2 trains on exactly as
    one process. The vocabulary is the checkpoint's own: 128 rows, Megatron's 16 x tp 2."""
    runs = {}
    for name, _, _ in PP2_FROM_TP2:
        output, directory = trained(trained_on, f"tp2_{name}")
        assert f"loaded Megatron checkpoint {tp2_untied}/iter_{ITERATION:07d}: iteration {ITERATION}, consumed samples {CONSUMED}" in output
        runs[name] = read_metrics(directory / "m.jsonl")
    one, pp2 = runs["one"], runs["pp2"]
    assert [m["iteration"] for m in one] == list(range(ITERATION + 1, ITERATION + 6))
    assert one[0]["consumed_samples"] == CONSUMED + 8
    for a, b in zip(one, pp2):
        assert b["iteration"] == a["iteration"] and abs(b["loss"] - a["loss"]) <= 1e-5 * abs(a["loss"])


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


@pytest.mark.slow
def test_train_py_refuses_a_megatron_checkpoint_of_another_shape_in_one_line(tp1_tied, tmp_path):
    proc = run_train(tmp_path, [*MEGATRON_RUN, "--model.untie_embeddings_and_output_weights=false", "--model.ffn_hidden_size=128",
                                f"--checkpoint.load={tp1_tied}"], check=False)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and "model.ffn_hidden_size: the checkpoint has 256 but the config has 128" in lines[0]


# -- optimizer state ---------------------------------------------------------------------------

ADAM_RUN = [
    *MEGATRON_RUN, "--model.untie_embeddings_and_output_weights=false", "--optimizer.lr_decay_style=constant",
    "--optimizer.lr_warmup_iters=0", *(f"--optimizer.{key}={value}" for key, value in ADAM.items()),
]  # fmt: skip


@pytest.fixture(scope="module")
def adam_tp1(tmp_path_factory):
    """megatron-core's distributed optimizer after one step, saved (model space, and the same state
    under dp_reshardable/ in Megatron-LM's default layout; in the per-rank format with its
    distrib_optim.pt under distrib_optim/, and from three buckets under distrib_optim_buckets/);
    its FP32Optimizer's under per_rank/; adam.pt holds their states then and after one more step
    on the batch dtgpt trains on next."""
    root = tmp_path_factory.mktemp("megatron_adam")
    run_megatron_gpt("adam", root, 1, "--sharding", "fully_reshardable", "dp_reshardable", "--per-rank")
    return root


def stacked_state(directory) -> dict:
    """A dtgpt checkpoint's weights and Adam moments in the layout of tests/megatron_adam.py."""
    sections = read_sections(directory, ("model", "optimizer"))
    layers: dict = {}
    for name, weight in sections["model"].items():
        key, layer = megatron_name(name)
        for slot in ("weight", "exp_avg", "exp_avg_sq"):
            value = weight if slot == "weight" else sections["optimizer"][f"state.{name}.{slot}"]
            layers.setdefault(slot, {}).setdefault(key, {})[layer] = value
    return {slot: {key: (torch.stack([v[i] for i in sorted(v)]) if None not in v else v[None]) for key, v in keys.items()}
            for slot, keys in layers.items()}  # fmt: skip


def without_key_bias(key: str, value: torch.Tensor) -> torch.Tensor:
    """The QKV bias without its key rows: their gradient is zero (softmax ignores a shift of the
    scores), so Adam divides rounding noise by its own size there and both sides step by noise."""
    if key != "decoder.layers.self_attention.linear_qkv.bias":
        return value
    return value.view(value.shape[0], HEADS, 3, -1)[:, :, [0, 2]]  # per head: [q | k | v]


def assert_state_close(ours: dict, theirs: dict, rtol: float) -> None:
    for slot in ("weight", "exp_avg", "exp_avg_sq"):
        assert ours[slot].keys() == theirs[slot].keys()
        for key, value in ours[slot].items():
            value, reference = without_key_bias(key, value), without_key_bias(key, theirs[slot][key])
            error = ((value - reference).norm() / reference.norm()).item()
            assert error <= rtol, (slot, key, error)


ROWS_32 = "--model.make_vocab_size_divisible_by=32"  # Megatron's 128 rows at tp 2
ADAM_LAYOUTS = (("one", 1, ITERATION, [], ""), ("tp2", 2, ITERATION + 1, ["--parallel.tensor_model_parallel_size=2"], ""),
                ("pp2", 2, ITERATION + 1, ["--parallel.pipeline_model_parallel_size=2"], ""),
                ("dp_reshardable_tp2", 2, ITERATION + 1, ["--parallel.tensor_model_parallel_size=2"], "dp_reshardable"),
                ("per_rank_tp2", 2, ITERATION + 1, ["--parallel.tensor_model_parallel_size=2"], "per_rank"),
                ("distrib_optim_pp2", 2, ITERATION + 1, ["--parallel.pipeline_model_parallel_size=2"], "distrib_optim_buckets"),
                ("saved_tp2pp2_one", 1, ITERATION + 1, [ROWS_32], "tp2pp2/gpt"),
                ("saved_tp2pp2_dp_reshardable_tp2", 2, ITERATION + 1, [ROWS_32, "--parallel.tensor_model_parallel_size=2"],
                 "tp2pp2/gpt/dp_reshardable"),
                ("saved_tp2pp2_distrib_optim_pp2", 2, ITERATION + 1, [ROWS_32, "--parallel.pipeline_model_parallel_size=2"],
                 "tp2pp2/gpt/distrib_optim_buckets"))  # fmt: skip
"""(name, ranks, train_iters, mesh, the megatron-core checkpoint: under adam_tp1 (saved at tp 1,
pp 1), "" its model-space save, dp_reshardable the same state in Megatron-LM's default per-bucket
layout, per_rank the FP32Optimizer's per-rank files, distrib_optim_buckets the distributed
optimizer's per-rank files and distrib_optim.pt (of three buckets); under adam_tp2pp2 (tp2pp2/),
the tied GPT's state saved at tp 2 x pp 2 in both torch_dist layouts and per rank, each rank's
distrib_optim.pt of its buckets)."""
MASTER_NOTE = "fp32 master weights (param), "
"""What the load log says of the master weights: the FP32Optimizer keeps none (its parameters are fp32)."""


def adam_source(request, source: str) -> Path:
    """An ADAM_LAYOUTS source: a directory of the adam_tp1 or (tp2pp2/) the adam_tp2pp2 fixture."""
    if source.startswith("tp2pp2/"):
        return request.getfixturevalue("adam_tp2pp2") / source.removeprefix("tp2pp2/")
    return request.getfixturevalue("adam_tp1") / source


@pytest.mark.slow
def test_megatron_adam_state_loads_and_steps_on_like_megatron(adam_tp1, trained_on, tmp_path):
    """Adam moments and master weights of megatron-core's distributed optimizer load at any mesh:
    equal as saved (one process), and one more step at tp2 or pp2 equals megatron-core's next step,
    from its default dp_reshardable layout too (tp2: each rank reads its shards out of the buckets),
    and from the per-rank format (--ckpt-format torch): its FP32Optimizer's state by parameter
    index (tp2) and its distributed optimizer's distrib_optim.pt (pp2) step on as megatron-core's.
    The stepped checkpoint then goes back (to-megatron) into megatron-core's optimizer, equal: its
    distributed optimizer from torch_dist, its FP32Optimizer from the per-rank format."""
    oracle = torch.load(adam_tp1 / "adam.pt", weights_only=True)
    ckpt = {}
    for name, *_, source in ADAM_LAYOUTS:
        log, directory = trained(trained_on, f"adam_{name}")
        master = "" if source == "per_rank" else MASTER_NOTE
        assert f"optimizer state loaded: {master}Adam moments, step 1" in log and "fresh AdamW" not in log
        ckpt[name] = directory / "ckpt"
    assert_state_close(stacked_state(layout.iteration_dir(ckpt["one"], ITERATION)), oracle["saved"], 1e-7)
    assert "dp_reshardable buckets (local layer order)" in trained(trained_on, "adam_dp_reshardable_tp2")[0]
    for name, stepped in (("tp2", "stepped"), ("pp2", "stepped"), ("dp_reshardable_tp2", "stepped"), ("per_rank_tp2", "stepped_per_rank"),
                          ("distrib_optim_pp2", "stepped")):  # tp2: DTensor shards of weights and moments
        assert_state_close(stacked_state(layout.iteration_dir(ckpt[name], ITERATION + 1)), oracle[stepped], 1e-5)
    # saved at tp 2 x pp 2: its buckets (each rank's tp shards), torch_dist's or each per-rank
    # file's distrib_optim.pt, step on as megatron-core's own gathering of them
    assert "dp_reshardable buckets (local layer order)" in trained(trained_on, "adam_saved_tp2pp2_dp_reshardable_tp2")[0]
    model_space = stacked_state(layout.iteration_dir(ckpt["saved_tp2pp2_one"], ITERATION + 1))
    for name in ("saved_tp2pp2_dp_reshardable_tp2", "saved_tp2pp2_distrib_optim_pp2"):
        assert_state_close(stacked_state(layout.iteration_dir(ckpt[name], ITERATION + 1)), model_space, 1e-5)
    stepped = layout.iteration_dir(ckpt["pp2"], ITERATION + 1)
    # and back into megatron-core's distributed optimizer
    out = tmp_path / "megatron"
    assert load_script().main(["to-megatron", str(stepped), str(out), "--tp", "1"]) == 0
    # and per rank: each file's optimizer entry as megatron-core's FP32Optimizer saves it
    assert load_script().main(["to-megatron", str(stepped), str(out / "per_rank"), "--format", "per-rank"]) == 0
    run_megatron_gpt("load-adam", out, 1)
    for name in ("loaded_adam.pt", "loaded_per_rank_adam.pt"):
        loaded = torch.load(out / name, weights_only=True)
        assert_state_close(stacked_state(stepped), {**loaded, "weight": loaded["param"]}, 0.0)
        assert_state_close(stacked_state(stepped), loaded, 0.0)
    # and the per-rank files read back into dtgpt as written
    reader, optimizer = MegatronReader(find(out / "per_rank")), read_sections(stepped, ("optimizer",))["optimizer"]
    shapes = full_model_shapes(model_cfg(), ROWS)
    reader.check(shapes, list(shapes))
    for name, shape in shapes.items():
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reader.tensor(name, shape, slot), optimizer[f"state.{name}.{slot}"]), (name, slot)


MEGATRON_OPTIMIZER_FILES = (("dp_reshardable", "saved_dp_reshardable", "param"), ("per_rank", "saved_per_rank", None),
                            ("distrib_optim", "saved", "param"), ("distrib_optim_buckets", "saved_dp_reshardable", "param"))  # fmt: skip
"""(directory under adam_tp1, its state in adam.pt, the slot of its master weights: None for the
FP32Optimizer, whose fp32 parameters are the weights)."""


@pytest.mark.slow
@pytest.mark.parametrize("source, held_as, master", MEGATRON_OPTIMIZER_FILES)
def test_megatron_optimizer_state_reads_as_megatron_holds_it(adam_tp1, source, held_as, master):
    """Megatron-LM's optimizer state reads, parameter by parameter, as megatron-core's optimizer
    held it when it saved, master weights and both moments bit for bit: from the distributed
    optimizer's default torch_dist layout (dp_reshardable: flat per-bucket buffers, three buckets
    here), and from the per-rank format: the FP32Optimizer's state by parameter index in three
    param groups (--decoupled-lr's among them), the distributed optimizer's distrib_optim.pt of one
    bucket and of three (coalesced)."""
    reader = MegatronReader(layout.iteration_dir(adam_tp1 / source, ITERATION))
    held = torch.load(adam_tp1 / "adam.pt", weights_only=True)[held_as]
    shapes = full_model_shapes(model_cfg(), ROWS)
    reader.check(shapes, list(shapes))
    if source == "dp_reshardable":
        found, spec = reader.bucket_layout()
        assert spec == "local" and len({piece.prefix for pieces in found.pieces.values() for piece in pieces}) == 3
    else:
        assert reader.per_rank_optimizer_problem() == "" and reader.optimizer_common() == {"common_step": 1.0}
    if source == "distrib_optim_buckets":  # coalesced: where megatron-core's DDP cut its buckets is recomputed
        saved = load_pickle(next(reader.directory.glob("mp_rank_00")) / PER_RANK_FILE)
        numels = [value.numel() for _, value in parameters(saved["model"])]
        assert bucket_lengths(numels, BUCKET_SIZE) == torch.load(adam_tp1 / "adam.pt", weights_only=True)["bucket_lengths"]
    for name, shape in shapes.items():
        key, layer = megatron_name(name)
        for slot, stored in (("param", master), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            theirs = held[slot][key] if layer is None else held[slot][key][layer]
            assert torch.equal(reader.tensor(name, shape, stored), theirs), (name, slot)


@pytest.mark.slow
def test_unmapped_per_rank_optimizer_state_is_one_line_and_fresh_adam(adam_tp1, tmp_path, capsys):
    """The distributed optimizer's per-rank files without their distrib_optim.pt: the weights load,
    Adam starts fresh, and the log says why in one line naming the file."""
    root = shutil.copytree(adam_tp1 / "distrib_optim", tmp_path / "distrib_optim")
    rank_dir = layout.iteration_dir(root, ITERATION) / "mp_rank_00"
    (rank_dir / "distrib_optim.pt").unlink()
    imported_loss(root, 16)
    why = f"{rank_dir / PER_RANK_FILE} is the distributed optimizer's, but {rank_dir / 'distrib_optim.pt'} is missing"
    assert f"Megatron checkpoint: optimizer state not read: {why}; fresh AdamW moments" in capsys.readouterr().out


TP2PP2_OPTIMIZER_FILES = ("dp_reshardable", "distrib_optim", "distrib_optim_buckets")
"""adam_tp2pp2's saves of each model besides megatron-core's model-space one (tests/megatron_adam.py
run_adam_parallel): torch_dist's dp_reshardable buckets, and the per-rank format with each
rank's distrib_optim.pt of one bucket and of PARALLEL_BUCKET_SIZE buckets."""


@pytest.mark.slow
@pytest.mark.parametrize("arch", [arch for arch, _ in PARALLEL_ADAM])
def test_optimizer_state_saved_at_tp2_pp2_reads_as_megatron_gathers_it(adam_tp2pp2, arch):
    """Saved by tp 2 x pp 2 ranks, each model-parallel rank's state (its stage, its tp shards:
    vocabulary rows, QKV rows, SwiGLU's [gate; up] rows, row-parallel columns) reads, tensor by
    tensor, bit for bit as megatron-core's model-space save of the same state, which gathers the
    shards itself: from torch_dist's dp_reshardable buckets, and from each per-rank file's
    distrib_optim.pt (--ckpt-format torch), whose bucket cuts dtgpt recomputes from the file
    alone as megatron-core's DDP made them (several buckets on the first stage, one on the last;
    the tied GPT's embedding and its last-stage copy each in a bucket of its own)."""
    cfg = model_cfg(make_vocab_size_divisible_by=32) if arch == "gpt" else family_cfg(arch)
    shapes = full_model_shapes(cfg, ROWS_TP2)
    readers = {source: MegatronReader(layout.iteration_dir(adam_tp2pp2 / arch / source, ITERATION)) for source in TP2PP2_OPTIMIZER_FILES}
    gathered = MegatronReader(layout.iteration_dir(adam_tp2pp2 / arch, ITERATION))
    for reader in (*readers.values(), gathered):
        reader.check(shapes, list(shapes))
    assert readers["dp_reshardable"].bucket_layout()[1] == "local" and gathered.bucket_layout()[0] is None
    for source in ("distrib_optim", "distrib_optim_buckets"):
        assert readers[source].per_rank_optimizer_problem() == "" and readers[source].optimizer_common() == {"common_step": 1.0}
    made = torch.load(adam_tp2pp2 / arch / "bucket_lengths.pt", weights_only=True)
    for rank_dir in sorted(readers["distrib_optim_buckets"].directory.glob("mp_rank_*")):
        saved = load_pickle(rank_dir / PER_RANK_FILE)
        assert candidate_cuts(parameters(saved["model"]), saved["args"], 2, int(rank_dir.name[-3:])) == [made[rank_dir.name]]
    assert len(made["mp_rank_00_000"]) > 1
    for name, shape in shapes.items():
        for slot in ("param", "exp_avg", "exp_avg_sq"):
            for source, reader in readers.items():
                assert torch.equal(reader.tensor(name, shape, slot), gathered.tensor(name, shape, slot)), (source, name, slot)


@pytest.mark.slow
def test_unmapped_distrib_optim_at_pp2_is_one_line_naming_the_file(adam_tp2pp2, tmp_path):
    """At tp 2 x pp 2: master weights that differ from the weights (one element of the first
    stage's buffer), and a last stage's distrib_optim.pt of two grad buffers (MoE experts, mixed
    dtypes), are found before any region is read, and the file named; virtual pipeline chunks are named."""
    directory = layout.iteration_dir(shutil.copytree(adam_tp2pp2 / "gpt" / "distrib_optim", tmp_path / "distrib_optim"), ITERATION)
    first, last = directory / "mp_rank_00_000", directory / "mp_rank_00_001"
    state = load_pickle(first / "distrib_optim.pt")
    state[0][(torch.float32, torch.float32)]["param"][0] += 1.0  # the first element of the last parameter in module order
    torch.save(state, first / "distrib_optim.pt")
    why = MegatronReader(directory).per_rank_optimizer_problem()
    assert why.startswith(f"{first / PER_RANK_FILE} has a distrib_optim.pt of ") and why.endswith("(its master weights differ from the weights)"), why
    state = load_pickle(last / "distrib_optim.pt")
    torch.save({**state, 1: state[0]}, last / "distrib_optim.pt")
    why = MegatronReader(directory).per_rank_optimizer_problem()
    assert why.startswith(f"{last / PER_RANK_FILE} has a distrib_optim.pt of 2 grad buffers or dtypes (MoE experts"), why
    with pytest.raises(Unmapped, match=r"with virtual pipeline chunks \(model0, model1: a grad buffer each"):
        file_state({"optimizer": {"optimizer": {"param_groups": []}}}, last, ["model0", "model1"], 2, 1)


@pytest.mark.slow
def test_shifted_model_space_adam_state_is_not_taken(adam_tp1, trained_on):
    """megatron-core 0.16.1's model-space (fully_reshardable) save of a grad buffer in three
    buckets writes the later buckets' state 64 elements off: its master weights differ from the
    model weights, so the run says why and starts AdamW fresh; the unshifted save agrees."""
    assert MegatronReader(layout.iteration_dir(adam_tp1, ITERATION)).masters_agree("param")
    assert not MegatronReader(layout.iteration_dir(adam_tp1 / SHIFTED, ITERATION)).masters_agree("param")
    log, directory = trained(trained_on, "adam_shifted")
    assert "optimizer state not read: its fp32 master weights (optimizer.state.param.*) differ from the model weights" in log
    steps = read_sections(layout.iteration_dir(directory / "ckpt", ITERATION + 1), ("optimizer",))["optimizer"]
    assert {float(v) for k, v in steps.items() if k.endswith(".step")} == {1.0}  # fresh AdamW, one step


@pytest.mark.slow
def test_load_optimizer_false_leaves_adam_fresh(trained_on):
    """Megatron's --no-load-optim: a fresh AdamW, but the iteration goes on from the checkpoint's."""
    log, directory = trained(trained_on, "adam_fresh")
    assert "optimizer state loaded" not in log
    steps = read_sections(layout.iteration_dir(directory / "ckpt", ITERATION + 1), ("optimizer",))["optimizer"]
    assert {float(v) for k, v in steps.items() if k.endswith(".step")} == {1.0}  # fresh AdamW, one step
