"""The train state and Checkpointer of one process (no torchrun), as train.py builds them: the
shared helpers of the checkpoint tests (tests/test_checkpoint_unit.py, test_checkpoint_writes.py and
the format, fault and conversion tests that save a small model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtgpt.api import build_model, build_train_state, init_distributed, train_step
from dtgpt.checkpoint import Checkpointer
from dtgpt.config import Config, load_config
from dtgpt.distributed import Runtime
from dtgpt.faults.injection import FaultHooks, build_faults
from dtgpt.state import TrainState

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
