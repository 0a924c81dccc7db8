"""Megatron's weight-decay schedule through a Megatron-LM checkpoint: `to-megatron` writes the
whole opt_param_scheduler (megatron-core's OptimizerParamScheduler loads it, checking its values
as on a Megatron resume), and a load follows its schedule by Megatron's rules
(dtgpt/checkpoint/megatron/scheduler.py)."""

from __future__ import annotations

import types
import warnings

import pytest

from dtgpt.checkpoint import CheckpointError, megatron
from dtgpt.checkpoint.megatron.reader import MegatronReader
from tests.checkpoints import checkpointer, make_trainer, step
from tests.test_checkpoint_convert import load_script
from tests.test_resume_controls import END_02, END_03, WD_SCHEDULE, group_wds

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes on its absent GPU kernels
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the trainer 2 iterations into a linear 0 -> 0.2 weight decay, its Megatron torch_dist root)."""
    tmp = tmp_path_factory.mktemp("wd")
    t = make_trainer(f"--checkpoint.save={tmp / 'ckpt'}", *WD_SCHEDULE, END_02)
    step(t, 2)
    checkpointer(t).save(2)
    assert load_script().main(["to-megatron", str(tmp / "ckpt"), str(tmp / "megatron")]) == 0
    return t, tmp / "megatron"


def loaded(root, *overrides: str):
    trainer = make_trainer(f"--checkpoint.load={root}", *overrides)
    checkpointer(trainer)  # loads
    return trainer


def test_megatron_core_loads_the_written_scheduler_and_sets_the_same_weight_decay(converted):
    t, root = converted
    state = MegatronReader(megatron.find(root)).common["opt_param_scheduler"]
    s, groups = t.state.lr_schedule, [{"wd_mult": 1.0}, {"wd_mult": 0.0}]
    theirs = OptimizerParamScheduler(
        types.SimpleNamespace(param_groups=groups), init_lr=0.0, max_lr=s.max_lr, min_lr=s.min_lr, lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=s.decay_steps, lr_decay_style=s.style, start_wd=0.0, end_wd=0.2, wd_incr_steps=40, wd_incr_style="linear",
        use_checkpoint_opt_param_scheduler=False,  # Megatron-LM's default (megatron-core's is True: no check)
    )  # fmt: skip
    theirs.load_state_dict(state)  # asserts each value equals its own
    assert [g["weight_decay"] for g in groups] == pytest.approx(group_wds(t)) and group_wds(t)[0] > 0
    theirs.end_wd = 0.3
    with pytest.raises(AssertionError, match="end weight decay"):
        theirs.load_state_dict(state)


def test_a_megatron_load_follows_its_weight_decay_schedule_by_megatrons_rules(converted):
    t, root = converted
    assert group_wds(loaded(root, *WD_SCHEDULE, END_02)) == pytest.approx(group_wds(t))
    with pytest.raises(CheckpointError, match=r"end weight decay is 0.3 here \(optimizer.end_weight_decay\) but 0.2 in the Megatron checkpoint"):
        loaded(root, *WD_SCHEDULE, END_03)
    assert group_wds(loaded(root, *WD_SCHEDULE, END_03, "--optimizer.override_opt_param_scheduler=true")) == pytest.approx([0.3 * 8 / 40, 0.0])
    assert group_wds(loaded(root, "--optimizer.use_checkpoint_opt_param_scheduler=true")) == pytest.approx(group_wds(t))
