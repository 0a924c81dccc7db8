"""The Checkpointer's loads in one process (no torchrun): exact restore of every optimizer's
state, weights only, the load directory's choices, and the wrong model or optimizer refused in one
line. Its saves (async, failed, truncated, pruned): tests/test_checkpoint_writes.py."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from dtgpt.checkpoint import CheckpointError, layout
from dtgpt.checkpoint.stored import optimizer_problem, stored_optimizer
from dtgpt.config import load_config
from tests.checkpoints import assert_same, checkpointer, flat_state, make_trainer, step

# One process and no process group: DCP notes that it saves as a single process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


OPTIMIZERS = {"adam": [], "sgd": ["--optimizer", "sgd", "--sgd-momentum", "0.8"], "muon": ["--optimizer", "muon", "--muon-nesterov"],
              "plain_sgd": ["--optimizer", "sgd", "--sgd-momentum", "0"]}  # fmt: skip
"""A run's optimizer -> its flags: Megatron's, as a launch script spells them."""
STORED = {"adam": "adam", "sgd": "sgd", "muon": "muon", "plain_sgd": None}
"""Whose optimizer state each run's checkpoint holds: SGD without momentum keeps none."""


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_save_load_restores_everything_exactly(tmp_path, optimizer):
    """Saved at iteration 3 and loaded into a fresh trainer, which then steps as the saver does:
    weights, the optimizer's state (AdamW's moments and step, SGD's momentum, Muon's momentum
    beside AdamW's moments; none for SGD without momentum), progress, RNG. The checkpoint is named
    by its state, so every other optimizer (dist_muon is muon) refuses it and a stateless one
    resumes under any."""
    a = make_trainer(f"--checkpoint.save={tmp_path}", *OPTIMIZERS[optimizer])
    step(a, 3)
    ckpt = checkpointer(a)
    ckpt.save(3)
    ckpt.finalize()
    assert layout.read_pointer(tmp_path) == 3 and layout.problem(layout.iteration_dir(tmp_path, 3)) is None
    rng = torch.get_rng_state()

    torch.manual_seed(999)
    b = make_trainer(f"--checkpoint.load={tmp_path}", *OPTIMIZERS[optimizer])
    assert not b.state.optimizer.optimizers[0].state
    assert any(not torch.equal(x, y) for x, y in zip(a.state.model.parameters(), b.state.model.parameters()))
    loaded = checkpointer(b)
    loaded.restore_rng()
    assert_same(flat_state(a), flat_state(b))
    assert b.state.progress == a.state.progress and b.state.lr_schedule.num_samples == a.state.lr_schedule.num_samples
    assert torch.equal(torch.get_rng_state(), rng)
    # the tied head was stored once, under the embedding's name
    keys = layout.read_metadata(layout.iteration_dir(tmp_path, 3)).state_dict_metadata
    assert "model.embedding.word.weight" in keys and "model.output.weight" not in keys
    assert not any(k.startswith("optimizer.param_groups") for k in keys)
    slots = {k.rsplit(".", 1)[1] for k in keys if k.startswith("optimizer.state.")}
    adam, sgd = {"exp_avg", "exp_avg_sq", "step"}, {"momentum_buffer"}
    assert slots == {"adam": adam, "sgd": sgd, "muon": adam | sgd, "plain_sgd": set()}[optimizer]
    metadata = layout.read_metadata(layout.iteration_dir(tmp_path, 3))
    assert stored_optimizer(metadata) == STORED[optimizer]
    for resumed in ("adam", "sgd", "muon", "dist_muon"):
        takes = STORED[optimizer] in (None, "muon" if resumed == "dist_muon" else resumed)
        assert (optimizer_problem({}, metadata, resumed) is None) == takes, resumed
    # both continue identically (the same dropout draws: both start from the restored state)
    step(a)
    torch.set_rng_state(rng)
    step(b)
    assert_same(flat_state(a), flat_state(b))


def test_train_state_round_trips_through_its_own_state_dict():
    """TrainState is a Stateful: another state takes it whole (weights, AdamW moments, progress,
    LR schedule, scaler) from state_dict(), in memory, without a checkpoint in between."""
    a, b = make_trainer(), make_trainer("--training.seed=7")
    step(a, 2)
    b.state.load_state_dict(a.state.state_dict())
    assert_same(flat_state(a), flat_state(b))
    assert b.state.progress == a.state.progress and b.state.progress.iteration == 2
    assert b.state.lr_schedule.state_dict() == a.state.lr_schedule.state_dict()
    assert b.state.scaler.state_dict() == a.state.scaler.state_dict()


def test_a_checkpoint_from_before_consumed_valid_samples_loads(tmp_path, monkeypatch):
    """Checkpoints written before train_state held consumed_valid_samples still load (the rest of
    the progress exactly, the missing counter as 0); a resumed run then places its validation
    stream by Megatron's backward-compatible rule: (iteration // eval_interval) evaluations of
    eval_iters global batches."""
    from dtgpt.api import resumed_valid_samples
    from dtgpt.state import Progress

    a = make_trainer(f"--checkpoint.save={tmp_path}", "--eval.eval_interval=2", "--eval.eval_iters=3")
    step(a, 5)
    a.state.progress.consumed_valid_samples = 999  # not stored below, so it must not come back
    older = Progress.state_dict
    monkeypatch.setattr(Progress, "state_dict", lambda self: {k: v for k, v in older(self).items() if k != "consumed_valid_samples"})
    ckpt = checkpointer(a)
    ckpt.save(5)
    ckpt.finalize()
    monkeypatch.undo()
    keys = layout.read_metadata(layout.iteration_dir(tmp_path, 5)).state_dict_metadata
    assert "train_state.iteration" in keys and "train_state.consumed_valid_samples" not in keys

    b = make_trainer(f"--checkpoint.load={tmp_path}", "--eval.eval_interval=2", "--eval.eval_iters=3")
    checkpointer(b)
    p = b.state.progress
    assert (p.iteration, p.consumed_samples, p.consumed_valid_samples) == (5, 5 * 4, 0)
    assert resumed_valid_samples(b.cfg, p) == (5 // 2) * 3 * 4
    p.consumed_valid_samples = 8  # a stored count is taken as it is
    assert resumed_valid_samples(b.cfg, p) == 8


WRONG_MODELS = [
    # override, what the saved config says (checked first), what the shapes say (without a config)
    ("--model.hidden_size=64", "model.hidden_size: the checkpoint has 32 but the config has 64",
     r"embedding.word.weight has shape \(128, 32\) in the checkpoint but \(128, 64\)"),
    ("--model.num_layers=3", "model.num_layers: the checkpoint has 2 but the config has 3",
     r"model tensor layers.2.input_norm.weight \(32,\) is not in the checkpoint"),
    ("--model.num_layers=1", "model.num_layers: the checkpoint has 2 but the config has 1",
     r"checkpoint tensor layers.1.input_norm.weight \(32,\) has no counterpart"),
    ("--model.untie_embeddings_and_output_weights=true",
     "model.untie_embeddings_and_output_weights: the checkpoint has false but the config has true",
     r"model tensor output.weight \(128, 32\) is not in"),
]


@pytest.mark.parametrize("override, named, shapes", WRONG_MODELS)
def test_wrong_model_names_the_key_or_the_tensor(tmp_path, override, named, shapes):
    """The saved config names the architecture key that differs; a checkpoint without one (e.g.
    written by another tool) is compared by its tensors' shapes."""
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    step(t)
    checkpointer(t).save(1)
    with pytest.raises(CheckpointError, match=named):
        checkpointer(make_trainer(f"--checkpoint.load={tmp_path}", override))
    directory = layout.iteration_dir(tmp_path, 1)
    (directory / layout.CONFIG).unlink()
    marker = layout.read_marker(directory)
    layout.write_marker(directory, {k: v for k, v in marker.items() if k != "checksums"})
    with pytest.raises(CheckpointError, match=shapes):
        checkpointer(make_trainer(f"--checkpoint.load={tmp_path}", override))


@pytest.mark.parametrize("saved, resumed", [("adam", "sgd"), ("sgd", "adam"), ("muon", "adam")])
def test_another_optimizers_state_is_one_error_or_a_fresh_start(tmp_path, saved, resumed):
    """AdamW's moments do not resume SGD (nor the reverse, nor Muon's AdamW): one line naming the key, both values
    and the way out; with checkpoint.load_optimizer=false the run starts its optimizer fresh on the
    checkpoint's weights and progress."""
    t = make_trainer(f"--checkpoint.save={tmp_path}", *OPTIMIZERS[saved])
    step(t, 2)
    checkpointer(t).save(2)
    line = (f"its optimizer state is {saved}'s, and optimizer.optimizer='{resumed}': one optimizer's state does not "
            f"resume another; set optimizer.optimizer='{saved}' to resume it, or checkpoint.load_optimizer=false")  # fmt: skip
    with pytest.raises(CheckpointError, match=re.escape(line)):
        checkpointer(make_trainer(f"--checkpoint.load={tmp_path}", f"--optimizer.optimizer={resumed}"))
    b = make_trainer(f"--checkpoint.load={tmp_path}", f"--optimizer.optimizer={resumed}", "--checkpoint.load_optimizer=false")
    checkpointer(b)
    assert b.state.progress.iteration == 2 and not b.state.optimizer.optimizers[0].state
    assert all(torch.equal(p, q) for p, q in zip(t.state.model.parameters(), b.state.model.parameters()))
    step(b)  # and it trains
    assert b.state.optimizer.optimizers[0].state


def test_empty_load_dir_errors_unless_it_is_the_save_dir(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        checkpointer(make_trainer(f"--checkpoint.load={empty}"))
    for extra in ([f"--checkpoint.save={empty}"], ["--checkpoint.auto_resume=true", f"--checkpoint.save={tmp_path / 'new'}"]):
        t = make_trainer(f"--checkpoint.load={empty}", *extra)
        checkpointer(t)
        assert t.state.progress.iteration == 0
        assert "starting from scratch" in capsys.readouterr().out


def test_auto_resume_reads_the_save_dir_and_saved_is_known(tmp_path):
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    step(t, 2)
    checkpointer(t).save(2)
    b = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.auto_resume=true")
    ckpt = checkpointer(b)
    assert b.state.progress.iteration == 2 and ckpt.saved(2) and not ckpt.saved(3)


def test_weights_only_load(tmp_path):
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    step(t, 2)
    checkpointer(t).save(2)
    b = make_trainer(f"--checkpoint.load={tmp_path}", "--checkpoint.finetune=true")
    checkpointer(b)
    assert b.state.progress.iteration == 0 and b.state.lr_schedule.num_samples == 0
    assert not b.state.optimizer.optimizers[0].state
    for (name, p), q in zip(t.state.model.named_parameters(), b.state.model.parameters()):
        assert torch.equal(p, q), name


def test_load_naming_an_iteration_directory_loads_it(tmp_path, capsys):
    """checkpoint.load=<root>/iter_0000001 means that checkpoint, not "no checkpoint here"."""
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    ckpt = checkpointer(t)
    for i in (1, 2):
        step(t)
        ckpt.save(i)
        if i == 1:
            first = flat_state(t)
    ckpt.finalize()
    b = make_trainer(f"--checkpoint.load={layout.iteration_dir(tmp_path, 1)}")
    checkpointer(b)
    assert b.state.progress.iteration == 1
    assert_same(flat_state(b), first)
    assert f"is an iteration directory: loading iteration 1 of {tmp_path}" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="is the directory of iteration 1, but checkpoint.load_iteration=2"):
        checkpointer(make_trainer(f"--checkpoint.load={layout.iteration_dir(tmp_path, 1)}", "--checkpoint.load_iteration=2"))


def test_a_resume_that_changes_the_lr_schedule_says_so(tmp_path, capsys):
    """With optimizer.override_opt_param_scheduler the schedule's lengths come from the config:
    stretching train_iters on resume moves the LR, and one line says which keys changed and the
    LR under each schedule (without the key the load refuses: tests/test_resume_controls.py)."""
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--optimizer.lr_decay_style=cosine")
    ckpt = checkpointer(t)
    step(t, 2)
    ckpt.save(2)
    ckpt.finalize()
    capsys.readouterr()
    checkpointer(make_trainer(f"--checkpoint.load={tmp_path}", "--optimizer.lr_decay_style=cosine"))
    assert "the LR schedule differs" not in capsys.readouterr().out
    b = make_trainer(f"--checkpoint.load={tmp_path}", "--optimizer.lr_decay_style=cosine", "--training.train_iters=20",
                     "--optimizer.override_opt_param_scheduler=true")  # fmt: skip
    checkpointer(b)
    out = capsys.readouterr().out
    assert "the LR schedule differs from the checkpoint's (training.train_iters 10 -> 20)" in out
    assert f"the LR after 8 samples is {b.state.lr_schedule.current_lr:.3e} (the checkpoint's schedule: {t.state.lr_schedule.current_lr:.3e})" in out


@pytest.mark.parametrize(
    "common, named",
    [({"iteration": "four"}, "iteration='four'"), ({"args": argparse.Namespace(consumed_train_samples=-16)}, "args.consumed_train_samples=-16")],
)
def test_megatron_counts_that_are_no_counts_are_one_clear_error(common, named):
    """A Megatron common.pt whose iteration or sample counts are not whole numbers >= 0 (train.py
    prints a CheckpointError as one line)."""
    from dtgpt.checkpoint.megatron.formats import progress_of

    with pytest.raises(CheckpointError, match=re.escape(f"common.pt holds {named}: not a count")):
        progress_of(common)


def test_saved_rng_states_apply_only_where_each_stage_holds_the_same_blocks():
    """A pp2 checkpoint's RNG states belong to its stages' blocks: resumed on another split of
    the layers they are derived anew, on the same split they are reused."""
    from types import SimpleNamespace

    from dtgpt.checkpoint.mesh import mesh_info, mesh_text, same_rng_coordinates

    dims = SimpleNamespace(world_size=2, pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=1)
    pp2 = ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_schedule=1F1B", "--model.num_layers=4"]
    even = mesh_info(load_config(None, pp2, check=False), dims)
    uneven = mesh_info(load_config(None, [*pp2, "--decoder-first-pipeline-num-layers=1"], check=False), dims)
    assert (even["layers_per_stage"], uneven["layers_per_stage"]) == ([2, 2], [1, 3])
    assert same_rng_coordinates(uneven, dict(uneven))
    assert not same_rng_coordinates(even, uneven)
    assert mesh_text(uneven) != mesh_text(even) and mesh_text(uneven).endswith("blocks per stage 1 3")
    before_recorded = {k: v for k, v in even.items() if k != "layers_per_stage"}
    assert same_rng_coordinates(before_recorded, even)
