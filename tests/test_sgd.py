"""Megatron's --optimizer sgd: dtgpt steps as megatron-core's own optimizer does.

megatron-core (tests/megatron_gpt.py sgd) saves its GPTModel's weights as Megatron-LM does, then
steps its optimizer, built with optimizer='sgd' and sgd_momentum 0.8, three times on dtgpt's mock
samples 56-79 (weight decay 0.1 on the matrices, none on biases and norms, the word embedding at
its decoupled LR, gradients clipped to norm 1). dtgpt loads that checkpoint with the launch-script
flags `--optimizer sgd --sgd-momentum 0.8` and trains the same three batches: every weight equals
megatron-core's. The parity of a parallel layout with one process is tests/test_parity.py's
sgd_dp_shard2_tp2; the save and resume of the momentum, tests/test_checkpoint_unit.py.
The same launch steps megatron-core's Muon (--optimizer muon) from the same weights: dtgpt's
Muon trains the same three batches to the same weights (the Muon tests: tests/test_muon.py).
"""

from __future__ import annotations

import pytest
import torch

from dtgpt.api import build_model, build_train_state, init_distributed, train_step
from dtgpt.checkpoint import Checkpointer
from dtgpt.checkpoint.megatron.keys import megatron_name
from dtgpt.config import load_config
from dtgpt.faults.injection import build_faults
from dtgpt.muon import MUON, MuonWithAdamW
from tests.megatron_adam import BATCH, SGD_MOMENTUM, SGD_STEPS, mock_batch
from tests.megatron_gpt import CONSUMED, VOCAB
from tests.megatron_checkpoints import ADAM_RUN, without_key_bias

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SGD_FLAGS = ["--optimizer", "sgd", "--sgd-momentum", str(SGD_MOMENTUM)]


def stacked_weights(model) -> dict[str, torch.Tensor]:
    """dtgpt's weights by Megatron key, the decoder layers stacked as megatron-core's are."""
    return stacked_by_key({name: value.detach().clone() for name, value in model.parts[0].state_dict().items()})


def stacked_by_key(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dtgpt's tensors by name (a model's, or a checkpoint's) by Megatron key, the layers stacked."""
    layers: dict[str, dict] = {}
    for name, value in weights.items():
        if name == "output.weight":  # the tied head: Megatron keeps the embedding only
            continue
        key, layer = megatron_name(name)
        layers.setdefault(key, {})[layer] = value
    return {key: torch.stack([v[i] for i in sorted(v)]) if None not in v else v[None] for key, v in layers.items()}


def update_errors(before: dict, ours: dict, theirs: dict) -> dict[str, float]:
    """Per Megatron key: how far dtgpt's weights are from megatron-core's, relative to how far
    megatron-core's three steps moved them (the key rows of the QKV bias left out: their gradient
    is zero up to rounding, so both sides step by noise there)."""
    assert ours.keys() == theirs.keys() == before.keys()
    errors = {}
    for key in theirs:
        a, b, start = (without_key_bias(key, t[key]) for t in (ours, theirs, before))
        errors[key] = ((a - b).norm() / (b - start).norm()).item()
    return errors


def steps_like_megatron_core(root, flags: list[str], capsys):
    """dtgpt loads megatron-core's checkpoint with `flags` and trains the three batches it stepped
    on; returns the optimizer and the update errors (update_errors) against megatron-core's."""
    theirs = torch.load(root / f"{flags[1]}.pt", weights_only=True)["weight"]
    cfg = load_config(None, [*ADAM_RUN, *flags, f"--checkpoint.load={root}"])
    runtime = init_distributed(cfg)
    state = build_train_state(cfg, build_model(cfg, runtime, VOCAB))
    Checkpointer(state, cfg, runtime, build_faults(cfg.faults, runtime.rank, runtime.restart_count))
    assert state.progress.consumed_samples == CONSUMED
    why = f"optimizer.optimizer='{flags[1]}'" if flags[1] == "sgd" else "the checkpoint holds no optimizer state in model space"
    assert f"optimizer state not read: {why}" in capsys.readouterr().out  # megatron-core saved the weights alone
    before = stacked_weights(state.model)
    for k in range(SGD_STEPS):
        train_step(cfg, state, mock_batch(CONSUMED + k * BATCH))
    return state.optimizer.optimizers[0], update_errors(before, stacked_weights(state.model), theirs)


@pytest.mark.slow
def test_megatron_sgd_steps_like_megatron_core(megatron_steps, capsys):
    optimizer, errors = steps_like_megatron_core(megatron_steps, SGD_FLAGS, capsys)
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == SGD_MOMENTUM
    assert max(errors.values()) <= 1e-4, errors


MUON_FLAGS = ["--optimizer", "muon", "--muon-nesterov", "--muon-fp32-matmul-prec", "high"]  # tests/megatron_muon.py MUON


@pytest.mark.slow
def test_megatron_muon_steps_like_megatron_cores_muon_builder(megatron_steps, capsys):
    """The same with Megatron's --optimizer muon: megatron-core's get_megatron_muon_optimizer (Muon
    for its matrices, the position embedding among them; Adam for the rest, the word embedding at
    its decoupled LR) and dtgpt's, three steps from the same weights: every weight equal."""
    if not (megatron_steps / "muon.pt").exists():
        pytest.skip("megatron-core's Muon needs emerging-optimizers (make setup) and megatron-core 0.16.1")
    optimizer, errors = steps_like_megatron_core(megatron_steps, MUON_FLAGS, capsys)
    assert isinstance(optimizer, MuonWithAdamW) and any(g.get(MUON) for g in optimizer.param_groups)
    assert max(errors.values()) <= 1e-4, errors


def test_sgd_checkpoint_goes_to_megatron_without_its_momentum(tmp_path):
    """to-megatron writes the weights and counts of an SGD run; megatron-core's model-space
    optimizer layout has no slot for SGD's momentum, so none is written (the script says so)."""
    from dtgpt.checkpoint import layout, megatron
    from dtgpt.checkpoint.megatron.reader import MegatronReader
    from tests.checkpoints import checkpointer, make_trainer, step

    t = make_trainer(f"--checkpoint.save={tmp_path / 'ckpt'}", *SGD_FLAGS)
    step(t, 2)
    checkpointer(t).save(2)
    written = megatron.to_megatron(layout.iteration_dir(tmp_path / "ckpt", 2), t.cfg, tmp_path / "megatron")
    keys = MegatronReader(written).shapes
    assert "embedding.word_embeddings.weight" in keys and not any(k.startswith("optimizer.") for k in keys)
