"""optimizer.decoupled_lr / decoupled_min_lr (Megatron's --decoupled-lr, --decoupled-min-lr)
against megatron-core itself: its _get_param_groups builds the groups of the same model (the word
embedding and the output weight carry the attribute Megatron's LanguageModule gives them), its
OptimizerParamScheduler steps them, and every parameter's LR and weight decay in dtgpt's AdamW
must equal Megatron's for its group at every step, over warmup, decay and past it, for each
decay style. The rules of the keys, and the resume check, are here too.
"""

from __future__ import annotations

import itertools
import types
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes on its absent GPU kernels
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core import optimizer_param_scheduler

from dtgpt.config import Config, ConfigError, ModelConfig, OptimizerConfig, TrainingConfig, validate
from dtgpt.decoupled_lr import DECOUPLED, EMBEDDING_OR_OUTPUT
from dtgpt.model import GPT
from dtgpt.optim import LRSchedule, build_optimizer
from tests.megatron_oracle import one_rank_group
from tests.test_megatron_oracle_schedules import LR_SCHEDULES, megatron_lengths

BOUNDS = {"both": dict(decoupled_lr=1e-2, decoupled_min_lr=5e-5), "peak_only": dict(decoupled_lr=1e-4)}


def _model(tied: bool) -> GPT:
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, max_position_embeddings=8,
                      untie_embeddings_and_output_weights=not tied)  # fmt: skip
    return GPT(cfg, 32)


def _megatron_groups(model: GPT, o: OptimizerConfig, tmp_path) -> list[dict]:
    """megatron-core's param groups of `model`, its parameters marked as Megatron's LanguageModule marks them."""
    for name, param in model.named_parameters():
        param.is_embedding_or_output_parameter = name in ("embedding.word.weight", "output.weight")
    config = mcore_optimizer.OptimizerConfig(lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                                             decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr)  # fmt: skip
    with one_rank_group(str(tmp_path)):  # it aligns the groups of all ranks with an all_gather_object
        return mcore_optimizer._get_param_groups([model], config, None)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("bounds", sorted(BOUNDS))
@pytest.mark.parametrize("name", ["linear", "cosine", "inverse_sqrt", "constant", "wsd_minus_sqrt"])
def test_group_lrs_follow_megatron(tmp_path, name, bounds, tied):
    cfg = Config(
        training=TrainingConfig(global_batch_size=8, train_iters=120),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, weight_decay=0.1, **BOUNDS[bounds], **LR_SCHEDULES[name]),
    )
    o, model = cfg.optimizer, _model(tied)
    groups = _megatron_groups(model, o, tmp_path)
    assert len(groups) == 3 and sum(not g["default_config"] for g in groups) == 1
    holder = types.SimpleNamespace(param_groups=groups)
    theirs = optimizer_param_scheduler.OptimizerParamScheduler(
        holder, init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        lr_wsd_decay_style=o.lr_wsd_decay_style, **megatron_lengths(cfg),
    )  # fmt: skip
    optimizer, ours = build_optimizer(model.named_parameters(), o), LRSchedule(cfg)
    assert len(optimizer.param_groups) == 3
    ours_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    pairs = [(theirs_group, ours_of[id(p)]) for theirs_group in groups for p in theirs_group["params"]]
    assert len(pairs) == len(ours_of)  # every parameter is in one group on each side (the tied weight once)
    decoupled = [p for g in optimizer.param_groups if g.get(DECOUPLED) for p in g["params"]]
    assert {id(p) for p in decoupled} == {id(p) for n, p in model.named_parameters() if n in EMBEDDING_OR_OUTPUT}
    for step, increment in enumerate(itertools.islice(itertools.cycle((8, 8, 7, 16, 1, 8)), 200)):
        ours.step(increment)
        theirs.step(increment)
        ours.apply(optimizer)
        for theirs_group, ours_group in pairs:
            assert ours_group["lr"] == pytest.approx(theirs_group["lr"], rel=1e-12, abs=0), (step, ours.num_samples)
            assert ours_group["weight_decay"] == theirs_group["weight_decay"]
    assert ours.num_samples > megatron_lengths(cfg)["lr_decay_steps"]


def test_position_embedding_follows_lr():
    """Megatron marks the word embedding only: the learned position embedding keeps lr."""
    model = _model(tied=False)
    optimizer = build_optimizer(model.named_parameters(), OptimizerConfig(decoupled_lr=1e-2))
    position = model.embedding.position.weight
    assert not any(g.get(DECOUPLED) for g in optimizer.param_groups if any(p is position for p in g["params"]))


@pytest.mark.parametrize(
    "keys, words",
    [
        (dict(decoupled_min_lr=1e-5), "optimizer.decoupled_min_lr=1e-05 needs optimizer.decoupled_lr"),
        (dict(decoupled_lr=-1.0), "optimizer.decoupled_lr=-1.0 must be a finite number >= 0"),
        (dict(decoupled_lr=1e-3, decoupled_min_lr=2e-3), "optimizer.decoupled_min_lr=0.002 must be <= optimizer.decoupled_lr=0.001"),
        (dict(min_lr=1e-4, decoupled_lr=1e-5), "optimizer.min_lr=0.0001 must be <= optimizer.decoupled_lr=1e-05"),
    ],
)
def test_bad_bounds_are_refused(keys, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
        validate(Config(optimizer=OptimizerConfig(**keys)))


def test_a_part_without_either_end_has_no_decoupled_group_and_its_state_round_trips():
    """A middle pipeline stage: two groups, and its AdamW state saves and loads."""
    from tests.test_weight_decay_groups import assert_state_round_trips

    part = _model(tied=False)
    part.embedding, part.output = None, None
    optimizer = assert_state_round_trips(part, OptimizerConfig(decoupled_lr=1e-2))
    assert len(optimizer.param_groups) == 2 and not any(g.get(DECOUPLED) for g in optimizer.param_groups)
