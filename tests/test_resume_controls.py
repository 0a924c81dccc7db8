"""Megatron's load controls in one process: checkpoint.finetune (--finetune),
checkpoint.load_optimizer=false (--no-load-optim), checkpoint.load_rng=false (--no-load-rng), and
the LR schedule's check on resume with optimizer.override_opt_param_scheduler and
optimizer.use_checkpoint_opt_param_scheduler."""

from __future__ import annotations

import pytest
import torch

from dtgpt.checkpoint import CheckpointError
from dtgpt.config import ConfigError
from tests.checkpoints import Trainer, checkpointer, make_trainer, step


@pytest.fixture
def saved(tmp_path):
    """A trainer two iterations in (dropout on: the RNG moved), saved, with its RNG at the save."""
    t = make_trainer(f"--checkpoint.save={tmp_path}")
    step(t, 2)
    checkpointer(t).save(2)
    return t, tmp_path, torch.get_rng_state()


def loaded(root, *overrides: str) -> Trainer:
    """A fresh trainer that loaded root (and put the RNG in place, as the trainer does)."""
    b = make_trainer(f"--checkpoint.load={root}", *overrides)
    checkpointer(b).restore_rng()
    return b


def same_weights(a: Trainer, b: Trainer) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state.model.parameters(), b.state.model.parameters()))


def fresh_rng_state() -> torch.Tensor:
    make_trainer()  # builds the model as every trainer does: the generator as a fresh run seeds it
    return torch.get_rng_state()


def test_finetune_loads_the_weights_only(saved):
    t, root, _ = saved
    b = loaded(root, "--checkpoint.finetune=true")
    p = b.state.progress
    assert (p.iteration, p.consumed_samples, b.state.lr_schedule.num_samples) == (0, 0, 0)
    assert not b.state.optimizer.optimizers[0].state and same_weights(t, b)
    assert torch.equal(torch.get_rng_state(), fresh_rng_state())


def test_no_load_optim_keeps_progress_and_rng(saved):
    """Megatron's --no-load-optim: AdamW, LR schedule and loss scale fresh (the schedule from 0
    samples); iteration, consumed samples and RNG from the checkpoint."""
    t, root, rng = saved
    b = loaded(root, "--checkpoint.load_optimizer=false")
    p = b.state.progress
    assert (p.iteration, p.consumed_samples) == (2, 8) and b.state.lr_schedule.num_samples == 0
    assert not b.state.optimizer.optimizers[0].state and same_weights(t, b)
    assert torch.equal(torch.get_rng_state(), rng)


def test_no_load_rng_keeps_the_fresh_seeding(saved):
    t, root, rng = saved
    b = loaded(root, "--checkpoint.load_rng=false")
    assert b.state.progress.iteration == 2 and b.state.optimizer.optimizers[0].state
    assert torch.equal(torch.get_rng_state(), fresh_rng_state()) and not torch.equal(torch.get_rng_state(), rng)
    loaded(root)  # and without the key, the checkpoint's
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize(
    "override, message",
    [
        ("--optimizer.lr=0.002", r"the LR schedule's learning rate is 0.002 here \(optimizer.lr\) but 0.0003 in the checkpoint"),
        ("--optimizer.min_lr=1e-05", r"minimum learning rate is 1e-05 here"),
        ("--training.train_iters=12", r"decay samples is 48 here \(training.train_iters\) but 40 in the checkpoint \(training.train_iters\)"),
        ("--optimizer.lr_warmup_iters=1", r"warmup samples is 4 here \(optimizer.lr_warmup_iters\) but 0 in the checkpoint"),
        ("--optimizer.lr_decay_style=cosine", r"learning rate decay style is cosine here"),
        ("--optimizer.weight_decay=0.1", r"weight decay is 0.1 here"),
        ("--decoupled-lr=0.002", r"output layer's peak and minimum learning rate is \(0.002, 0.0\) here \(optimizer.decoupled_lr\) "
                                 r"but \(0.0003, 0.0\) in the checkpoint"),
    ],
)
def test_a_changed_schedule_is_refused_naming_the_value(saved, override, message):
    """Megatron asserts each scheduler value equals the checkpoint's unless told which to follow."""
    _, root, _ = saved
    with pytest.raises(CheckpointError, match=message + ".*override_opt_param_scheduler=true.*use_checkpoint_opt_param_scheduler=true"):
        loaded(root, override)


def test_override_follows_the_config_and_use_checkpoint_the_checkpoint(saved):
    _, root, _ = saved
    changed = ["--optimizer.lr=0.002", "--training.train_iters=12", "--optimizer.weight_decay=0.1"]
    ours = loaded(root, *changed, "--optimizer.override_opt_param_scheduler=true").state
    assert (ours.lr_schedule.max_lr, ours.lr_schedule.decay_steps, ours.lr_schedule.num_samples) == (0.002, 48, 8)
    assert ours.optimizer.optimizers[0].param_groups[0]["weight_decay"] == 0.1
    theirs = loaded(root, *changed, "--optimizer.use_checkpoint_opt_param_scheduler=true").state
    assert (theirs.lr_schedule.max_lr, theirs.lr_schedule.decay_steps, theirs.lr_schedule.num_samples) == (3e-4, 40, 8)
    assert theirs.optimizer.optimizers[0].param_groups[0]["weight_decay"] == 0.01
    assert theirs.lr_schedule.current_lr == pytest.approx(3e-4 * (1 - 8 / 40))


def test_no_check_when_the_schedule_is_not_loaded(saved):
    _, root, _ = saved
    for fresh in ("--checkpoint.load_optimizer=false", "--checkpoint.finetune=true"):
        assert loaded(root, "--optimizer.lr=0.002", fresh).state.lr_schedule.max_lr == 0.002


def test_the_two_schedule_keys_exclude_each_other():
    with pytest.raises(ConfigError, match="override_opt_param_scheduler and optimizer.use_checkpoint_opt_param_scheduler cannot both be true"):
        make_trainer("--optimizer.override_opt_param_scheduler=true", "--optimizer.use_checkpoint_opt_param_scheduler=true")


DECOUPLED = ("--decoupled-lr=0.002", "--decoupled-min-lr=1e-05")


def group_lrs(trainer: Trainer) -> list[float]:
    """Each AdamW group's LR as the next step would set it."""
    optimizer = trainer.state.optimizer.optimizers[0]
    trainer.state.lr_schedule.apply(optimizer)
    return [group["lr"] for group in optimizer.param_groups]


def test_decoupled_lr_resumes_and_follows_the_schedule_keys(tmp_path):
    """A checkpoint trained with decoupled_lr loads with its third group's AdamW state; a changed
    decoupled_lr is refused as a changed lr is, followed under override_opt_param_scheduler, and
    the checkpoint's comes back under use_checkpoint_opt_param_scheduler (also with the key unset here)."""
    t = make_trainer(f"--checkpoint.save={tmp_path}", *DECOUPLED)
    step(t, 2)
    checkpointer(t).save(2)
    same = loaded(tmp_path, *DECOUPLED)
    assert same_weights(t, same) and group_lrs(same) == group_lrs(t) and len(group_lrs(t)) == 3
    assert group_lrs(t)[2] == pytest.approx(1e-5 + (0.002 - 1e-5) * (1 - 8 / 40))  # linear decay, 8 of 40 samples
    embedding = same.state.model.parts[0].embedding.word.weight
    assert torch.equal(same.state.optimizer.optimizers[0].state[embedding]["exp_avg"],
                       t.state.optimizer.optimizers[0].state[t.state.model.parts[0].embedding.word.weight]["exp_avg"])  # fmt: skip
    with pytest.raises(CheckpointError, match=r"peak and minimum learning rate is \(0.004, 1e-05\) here"):
        loaded(tmp_path, "--decoupled-lr=0.004", "--decoupled-min-lr=1e-05")
    ours = loaded(tmp_path, "--decoupled-lr=0.004", "--optimizer.override_opt_param_scheduler=true")
    assert group_lrs(ours)[2] == pytest.approx(0.004 * (1 - 8 / 40))
    theirs = loaded(tmp_path, "--decoupled-lr=0.004", "--optimizer.weight_decay=0.1", "--optimizer.use_checkpoint_opt_param_scheduler=true")
    assert group_lrs(theirs) == pytest.approx(group_lrs(t))
    assert [g["weight_decay"] for g in theirs.state.optimizer.optimizers[0].param_groups] == [0.01, 0.0, 0.01]
    with pytest.raises(CheckpointError, match=r"optimizer.decoupled_lr=0.002: set optimizer.decoupled_lr"):
        loaded(tmp_path, "--optimizer.use_checkpoint_opt_param_scheduler=true")


def test_no_save_optim_saves_without_it_and_a_resume_starts_it_fresh(tmp_path):
    """Megatron's --no-save-optim (checkpoint.save_optimizer=false): no AdamW state, LR schedule or
    loss scale on disk; a plain resume from it then is --no-load-optim's: fresh AdamW and schedule,
    iteration, consumed samples, weights and RNG from the checkpoint."""
    import torch.distributed.checkpoint as dcp

    from dtgpt.checkpoint import layout

    t = make_trainer(f"--checkpoint.save={tmp_path}", "--checkpoint.save_optimizer=false")
    step(t, 2)
    checkpointer(t).save(2)
    rng = torch.get_rng_state()
    sections = {key.split(".")[0] for key in dcp.FileSystemReader(str(layout.iteration_dir(tmp_path, 2))).read_metadata().state_dict_metadata}
    assert sections == {"model", "rng", "train_state"}
    b = loaded(tmp_path)  # no load key: the checkpoint has nothing to give
    p = b.state.progress
    assert (p.iteration, p.consumed_samples) == (2, 8) and b.state.lr_schedule.num_samples == 0
    assert not b.state.optimizer.optimizers[0].state and same_weights(t, b)
    assert torch.equal(torch.get_rng_state(), rng)
    assert loaded(tmp_path, "--optimizer.lr=0.002").state.lr_schedule.max_lr == 0.002  # no schedule to check against


WD_SCHEDULE = ("--weight-decay-incr-style=linear", "--start-weight-decay=0.0")
END_02, END_03 = "--end-weight-decay=0.2", "--end-weight-decay=0.3"


def group_wds(trainer: Trainer) -> list[float]:
    """Each AdamW group's weight decay as the next step would set it."""
    optimizer = trainer.state.optimizer.optimizers[0]
    trainer.state.lr_schedule.apply(optimizer)
    return [group["weight_decay"] for group in optimizer.param_groups]


def test_weight_decay_schedule_resumes_and_follows_the_schedule_keys(tmp_path, capsys):
    """A run with Megatron's linear weight-decay increment (0 -> 0.2 over 40 samples) resumes at
    its weight decay; a changed end is refused as Megatron's scheduler refuses it, followed under
    override_opt_param_scheduler, and the checkpoint's schedule comes back under
    use_checkpoint_opt_param_scheduler, also with a constant decay here."""
    t = make_trainer(f"--checkpoint.save={tmp_path}", *WD_SCHEDULE, END_02)
    step(t, 2)
    checkpointer(t).save(2)
    assert group_wds(t) == pytest.approx([0.2 * 8 / 40, 0.0])
    assert group_wds(loaded(tmp_path, *WD_SCHEDULE, END_02)) == pytest.approx(group_wds(t))
    with pytest.raises(CheckpointError, match=r"end weight decay is 0.3 here \(optimizer.end_weight_decay\) but 0.2 in the checkpoint"):
        loaded(tmp_path, *WD_SCHEDULE, END_03)
    with pytest.raises(CheckpointError, match=r"start weight decay is 0.01 here \(optimizer.weight_decay\) but 0.0 in the checkpoint \(optimizer.start_weight_decay\)"):
        loaded(tmp_path)
    ours = loaded(tmp_path, *WD_SCHEDULE, END_03, "--optimizer.override_opt_param_scheduler=true")
    assert group_wds(ours) == pytest.approx([0.3 * 8 / 40, 0.0])
    assert "the weight decay is 6.000e-02 (the checkpoint's schedule: 4.000e-02)" in capsys.readouterr().out
    theirs = loaded(tmp_path, "--optimizer.use_checkpoint_opt_param_scheduler=true")
    assert group_wds(theirs) == pytest.approx(group_wds(t))
