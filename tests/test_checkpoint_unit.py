"""The Checkpointer in one process (no torchrun): exact restore, async == sync, atomicity,
partial and truncated checkpoints, shape errors, keep_last, starting fresh, weights only."""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from dtgpt.checkpoint import CheckpointError, Checkpointer, layout
from dtgpt.checkpoint.export import read_sections
from dtgpt.config import load_config
from dtgpt.api import build_model, build_train_state, init_distributed, train_step
from dtgpt.config import Config
from dtgpt.distributed import Runtime
from dtgpt.faults.injection import FaultHooks, build_faults
from dtgpt.state import TrainState

# One process and no process group: DCP notes that it saves as a single process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

VOCAB = 128
SMALL = [
    "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4", "--model.seq_length=16",
    "--model.hidden_dropout=0.1", "--model.attention_dropout=0.0", "--training.micro_batch_size=2",
    "--training.global_batch_size=4", "--training.train_iters=10", "--data.mock_data=true",
    "--data.tokenizer_type=NullTokenizer", f"--data.vocab_size={VOCAB}", "--data.num_workers=0",
]  # fmt: skip


@dataclass
class Trainer:
    """What a run of train.py holds: its config, its runtime and its train state."""

    cfg: Config
    runtime: Runtime
    state: TrainState
    faults: FaultHooks


def make_trainer(*overrides: str) -> Trainer:
    cfg = load_config(None, SMALL + list(overrides))
    runtime = init_distributed(cfg)
    state = build_train_state(cfg, build_model(cfg, runtime, VOCAB))
    return Trainer(cfg, runtime, state, build_faults(cfg.faults, runtime.rank, runtime.restart_count))


def checkpointer(trainer: Trainer) -> Checkpointer:
    """The Checkpointer of the trainer's state, as train.py builds it."""
    return Checkpointer(trainer.state, trainer.cfg, trainer.runtime, trainer.faults)


def step(trainer: Trainer, n: int = 1) -> None:
    """n training iterations on random tokens, advancing the state as the trainer does."""
    gbs = trainer.cfg.training.global_batch_size
    for _ in range(n):
        g = torch.Generator().manual_seed(trainer.state.progress.iteration)  # the same data in every trainer
        train_step(trainer.cfg, trainer.state, torch.randint(0, VOCAB, (gbs, trainer.cfg.model.seq_length + 1), generator=g))


def flat_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    part, opt = trainer.state.model.parts[0], trainer.state.optimizer.optimizers[0]
    out = {f"p.{k}": v.detach().clone() for k, v in part.state_dict().items()}
    names = {id(p): n for n, p in part.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"o.{names[id(p)]}.{k}"] = v.clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


OPTIMIZERS = {"adam": [], "sgd": ["--optimizer", "sgd", "--sgd-momentum", "0.8"], "muon": ["--optimizer", "muon", "--muon-nesterov"]}
"""optimizer.optimizer -> its flags: Megatron's, as a launch script spells them."""


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_save_load_restores_everything_exactly(tmp_path, optimizer):
    """Saved at iteration 3 and loaded into a fresh trainer, which then steps as the saver does:
    weights, the optimizer's state (AdamW's moments and step, SGD's momentum, Muon's momentum
    beside AdamW's moments), progress, RNG."""
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
    assert slots == {"adam": adam, "sgd": sgd, "muon": adam | sgd}[optimizer]
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


def slow_writes(monkeypatch, seconds: float) -> None:
    """Make DCP's file writes slow, so a save is still in flight while training goes on."""
    original = dcp_fs._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)

    monkeypatch.setattr(dcp_fs._FileSystemWriter, "write_data", write_data)


def held_writes(monkeypatch) -> tuple[threading.Event, list[bool]]:
    """DCP's file writes wait until the returned event is set (at most 120 s), so a save stays in
    flight while training goes on however fast or slow the machine; the list gets True once a
    write has gone through."""
    original, release, written = dcp_fs._FileSystemWriter.write_data, threading.Event(), []

    def write_data(self, plan, planner):
        release.wait(timeout=120)  # a save that held training would hold it this long
        future = original(self, plan, planner)
        written.append(True)
        return future

    monkeypatch.setattr(dcp_fs._FileSystemWriter, "write_data", write_data)
    return release, written


def test_async_save_equals_sync_save_while_training_mutates(tmp_path, monkeypatch):
    sync_root, async_root = tmp_path / "sync", tmp_path / "async"
    t = make_trainer(f"--checkpoint.save={sync_root}")
    step(t, 2)
    checkpointer(t).save(2)
    t.cfg.checkpoint.save, t.cfg.checkpoint.async_save = str(async_root), True
    ckpt = checkpointer(t)
    release, written = held_writes(monkeypatch)
    try:
        ckpt.save(2)
        assert not written, "training was held until the write went through"
        step(t, 2)  # mutates parameters, exp_avg, step counters while the write is in flight
        assert layout.read_pointer(async_root) is None, "pointer moved before the write completed"
        assert not (layout.iteration_dir(async_root, 2) / layout.MARKER).exists()
    finally:
        release.set()
    ckpt.finalize()
    assert layout.read_pointer(async_root) == 2
    a = read_sections(layout.iteration_dir(sync_root, 2))
    b = read_sections(layout.iteration_dir(async_root, 2))
    assert a.keys() == b.keys() == {"model", "optimizer", "train_state", "lr_schedule", "loss_scaler", "rng"}
    for section in a:
        assert_same(a[section], b[section])


def test_async_saves_one_in_flight_and_pointer_follows(tmp_path, monkeypatch):
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.async_save=true", "--checkpoint.keep_last=2")
    ckpt = checkpointer(t)
    slow_writes(monkeypatch, 0.2)
    for i in range(1, 5):
        step(t)
        ckpt.save(i)  # waits for the previous one, which then completes and moves the pointer
        assert layout.read_pointer(tmp_path) == (i - 1 if i > 1 else None)
    ckpt.finalize()
    assert layout.read_pointer(tmp_path) == 4
    assert layout.list_iterations(tmp_path) == [3, 4]  # keep_last=2 pruned 1 and 2


def fail_finish(monkeypatch):
    """DCP writes the data files, then fails before its .metadata: a partial directory."""

    def finish(self, metadata, results):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(dcp_fs._FileSystemWriter, "finish", finish)


def test_failed_save_keeps_pointer_and_is_skipped_on_load(tmp_path, monkeypatch, capsys):
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    step(t)
    ckpt = checkpointer(t)
    ckpt.save(1)
    step(t)
    with monkeypatch.context() as m:
        fail_finish(m)
        with pytest.raises(Exception, match="disk full"):
            ckpt.save(2)
    assert layout.read_pointer(tmp_path) == 1
    assert layout.problem(layout.iteration_dir(tmp_path, 2)) == "no such directory"  # only its staging copy
    assert "no .metadata" in layout.problem(layout.staging_dir(layout.iteration_dir(tmp_path, 2)))
    # a pointer that names the missing directory (e.g. written by hand) falls back to iteration 1
    layout.write_pointer(tmp_path, 2)
    b = make_trainer(f"--checkpoint.load={tmp_path}")
    checkpointer(b)
    assert b.state.progress.iteration == 1
    out = capsys.readouterr().out
    assert "iter_0000002 is not usable" in out and "falling back to" in out


def test_failed_async_save_keeps_pointer_and_finalize_raises(tmp_path, monkeypatch):
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.async_save=true")
    ckpt = checkpointer(t)
    step(t)
    ckpt.save(1)
    ckpt.finalize()
    step(t)
    fail_finish(monkeypatch)
    ckpt.save(2)
    with pytest.raises(CheckpointError, match="disk full"):
        ckpt.finalize()
    assert layout.read_pointer(tmp_path) == 1
    assert not (layout.iteration_dir(tmp_path, 2) / layout.MARKER).exists()


def test_truncated_checkpoint_is_detected(tmp_path, capsys):
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    ckpt = checkpointer(t)
    for i in (1, 2):
        step(t)
        ckpt.save(i)
    data = layout.iteration_dir(tmp_path, 2) / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"load_iteration=2: .* truncated"):
        checkpointer(make_trainer(f"--checkpoint.load={tmp_path}", "--checkpoint.load_iteration=2"))
    b = make_trainer(f"--checkpoint.load={tmp_path}")
    checkpointer(b)
    assert b.state.progress.iteration == 1
    assert "truncated" in capsys.readouterr().out
    # with no complete checkpoint left, a load is an error (starting fresh would replace them)
    (layout.iteration_dir(tmp_path, 1) / layout.MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"none of its completed checkpoints \(iterations \[2\]\) loads now"):
        checkpointer(make_trainer(f"--checkpoint.load={tmp_path}"))


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


def test_keep_last_never_deletes_pointed_or_newer(tmp_path):
    t = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.keep_last=2")
    ckpt = checkpointer(t)
    for i in range(1, 5):
        step(t)
        ckpt.save(i)
    assert layout.list_iterations(tmp_path) == [3, 4] and layout.read_pointer(tmp_path) == 4
    # an older run's newer checkpoint (iteration 9) is left alone; a stale partial older one goes
    (tmp_path / "iter_0000009").mkdir()
    (tmp_path / "iter_0000002").mkdir()
    step(t)
    ckpt.save(5)
    assert layout.list_iterations(tmp_path) == [4, 5, 9]
    marker = json.loads((layout.iteration_dir(tmp_path, 5) / layout.MARKER).read_text())
    assert marker["iteration"] == 5 and marker["mesh"]["world_size"] == 1
    assert (layout.iteration_dir(tmp_path, 5) / layout.CONFIG).read_text().startswith("[model]")


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


def test_a_pointer_that_is_a_directory_is_one_clear_error(tmp_path):
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    ckpt = checkpointer(t)
    step(t)
    ckpt.save(1)
    (tmp_path / layout.POINTER).unlink()
    (tmp_path / layout.POINTER).mkdir()
    step(t)
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt is a directory, so the pointer to iteration 2"):
        ckpt.save(2)


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


def test_a_short_write_is_named_for_what_it_usually_is():
    """torch's zip writer reports a full disk as "unexpected pos"; the save error says what that means."""
    error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    assert layout.describe(error).endswith("(the file came out shorter than written: usually no space left on the device)")
    assert layout.describe(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"


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
