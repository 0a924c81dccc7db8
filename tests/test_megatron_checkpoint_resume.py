"""megatron-core's checkpoints trained on by train.py, and their optimizer state.

megatron-core saves a 2-layer GPT at tp 2 (untied, on 2 gloo ranks): dtgpt gives its logits, reads
its iteration and sample counts, and trains on from it at pp2 exactly as one process. Its
distributed optimizer and FP32Optimizer, stepped once and saved in every layout Megatron-LM
writes (model space, dp_reshardable buckets, the per-rank files), read as megatron-core held
them, and step on at tp2 or pp2 as megatron-core's next step. The train.py runs of every selected
test start in one launch per rank count (the trained_on fixture), so they stay in this module.
megatron-core's tp 1 save read and refused, the per-rank format and the way out:
tests/test_megatron_checkpoint.py. All of it is marked slow (`make test` runs it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.export import read_sections
from dtgpt.checkpoint.megatron import find, load_megatron_model
from dtgpt.checkpoint.megatron.distrib_optim import bucket_lengths
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE, load_pickle, progress_of
from dtgpt.checkpoint.megatron.keys import full_model_shapes, megatron_name
from dtgpt.checkpoint.megatron.per_rank_optim import parameters
from dtgpt.checkpoint.megatron.reader import MegatronReader
from tests.megatron_adam import BUCKET_SIZE, SHIFTED
from tests.megatron_checkpoints import ADAM_RUN, MEGATRON_RUN, ROWS, ROWS_TP2, assert_same_logits, imported_loss, model_cfg, without_key_bias
from tests.megatron_gpt import CONSUMED, CONSUMED_VALID, ITERATION, LR_SAMPLES, VIRTUAL_ADAM
from tests.megatron_oracle import run_megatron_gpt
from tests.runs import Command, launch_commands, read_metrics, selected_cases
from tests.test_checkpoint_convert import load_script


@pytest.fixture(scope="module")
def tp2_untied(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_tp2")
    run_megatron_gpt("save", root, 2, "--untied")
    return root


@pytest.mark.slow
def test_tp2_untied_torch_dist_gives_megatron_logits(tp2_untied):
    directory = find(tp2_untied)
    assert MegatronReader(directory).shapes["embedding.word_embeddings.weight"] == (ROWS_TP2, 64)  # 16 x tp 2
    assert_same_logits(tp2_untied, directory, model_cfg(untie_embeddings_and_output_weights=True), rows=ROWS_TP2)


@pytest.mark.slow
def test_trainer_state_is_read(tp2_untied):
    common = MegatronReader(find(tp2_untied)).common
    assert progress_of(common) == {"iteration": ITERATION, "consumed_samples": CONSUMED, "consumed_valid_samples": CONSUMED_VALID,
                                   "lr_num_samples": LR_SAMPLES}


@pytest.mark.slow
def test_an_untied_checkpoint_into_a_tied_model_is_refused(tp2_untied):
    with pytest.raises(CheckpointError, match="model.untie_embeddings_and_output_weights: the checkpoint has true but the config has false"):
        load_megatron_model(find(tp2_untied), model_cfg(), ROWS_TP2)


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


# -- optimizer state ---------------------------------------------------------------------------

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


def assert_state_close(ours: dict, theirs: dict, rtol: float) -> None:
    for slot in ("weight", "exp_avg", "exp_avg_sq"):
        assert ours[slot].keys() == theirs[slot].keys()
        for key, value in ours[slot].items():
            value, reference = without_key_bias(key, value), without_key_bias(key, theirs[slot][key])
            error = ((value - reference).norm() / reference.norm()).item()
            assert error <= rtol, (slot, key, error)


ROWS_32 = "--model.make_vocab_size_divisible_by=32"  # Megatron's 128 rows at tp 2
VP_LAYERS = f"--model.num_layers={VIRTUAL_ADAM[1]}"  # the GPT megatron-core saves with virtual pipeline stages
ADAM_LAYOUTS = (("one", 1, ITERATION, [], ""), ("tp2", 2, ITERATION + 1, ["--parallel.tensor_model_parallel_size=2"], ""),
                ("pp2", 2, ITERATION + 1, ["--parallel.pipeline_model_parallel_size=2"], ""),
                ("dp_reshardable_tp2", 2, ITERATION + 1, ["--parallel.tensor_model_parallel_size=2"], "dp_reshardable"),
                ("per_rank_tp2", 2, ITERATION + 1, ["--parallel.tensor_model_parallel_size=2"], "per_rank"),
                ("distrib_optim_pp2", 2, ITERATION + 1, ["--parallel.pipeline_model_parallel_size=2"], "distrib_optim_buckets"),
                ("saved_tp2pp2_one", 1, ITERATION + 1, [ROWS_32], "tp2pp2/gpt"),
                ("saved_tp2pp2_dp_reshardable_tp2", 2, ITERATION + 1, [ROWS_32, "--parallel.tensor_model_parallel_size=2"],
                 "tp2pp2/gpt/dp_reshardable"),
                ("saved_tp2pp2_distrib_optim_pp2", 2, ITERATION + 1, [ROWS_32, "--parallel.pipeline_model_parallel_size=2"],
                 "tp2pp2/gpt/distrib_optim_buckets"),
                ("saved_vp_one", 1, ITERATION + 1, [ROWS_32, VP_LAYERS], f"tp2pp2/{VIRTUAL_ADAM[0]}"),
                ("saved_vp_dp_reshardable_pp2", 2, ITERATION + 1, [ROWS_32, VP_LAYERS, "--parallel.pipeline_model_parallel_size=2"],
                 f"tp2pp2/{VIRTUAL_ADAM[0]}/dp_reshardable"))  # fmt: skip
"""(name, ranks, train_iters, mesh, the megatron-core checkpoint: under adam_tp1 (saved at tp 1,
pp 1), "" its model-space save, dp_reshardable the same state in Megatron-LM's default per-bucket
layout, per_rank the FP32Optimizer's per-rank files, distrib_optim_buckets the distributed
optimizer's per-rank files and distrib_optim.pt (of three buckets); under adam_tp2pp2 (tp2pp2/),
the tied GPT's state saved at tp 2 x pp 2 in both torch_dist layouts and per rank, each rank's
distrib_optim.pt of its buckets; saved_vp: the same with 2 virtual stages per pp rank, a grad buffer each)."""
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
    # saved with virtual pipeline stages: each model chunk's grad buffer, stepped on at pp 2
    stepped_vp = stacked_state(layout.iteration_dir(ckpt["saved_vp_dp_reshardable_pp2"], ITERATION + 1))
    assert_state_close(stepped_vp, stacked_state(layout.iteration_dir(ckpt["saved_vp_one"], ITERATION + 1)), 1e-5)
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
