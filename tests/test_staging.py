"""Async saves stage dtgpt's state with torch's own stager on every torch dtgpt accepts
(dtgpt/checkpoint/staging.py): torch 2.11's copier had no entry for classes, and a DTensor's
deep copy meets its class."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.tensor import DTensor

from dtgpt import shutdown
from dtgpt.checkpoint.staging import build_stager
from tests.test_checkpoint_unit import make_trainer, step


@pytest.fixture
def fp16_state():
    """The exact state an async save of a fp16 run hands the stager (its weights are DTensors)."""
    trainer = make_trainer("--training.fp16=true")
    step(trainer)
    state = trainer.state.state_dict()
    assert any(isinstance(v, DTensor) for v in state["model"].values())
    yield state
    shutdown()


@pytest.fixture
def torch_2_11_copier(monkeypatch):
    """torch's stager as 2.11 ships it: no copier for classes."""
    init = StateDictStager.__init__

    def without_classes(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._deepcopy_dispatch.pop(type, None)

    monkeypatch.setattr(StateDictStager, "__init__", without_classes)


def assert_staged(staged: dict, state: dict) -> None:
    for section, values in state.items():
        for key, value in values.items():
            copy = staged[section][key]
            local = value.to_local() if isinstance(value, DTensor) else value
            copy_local = copy.to_local() if isinstance(copy, DTensor) else copy
            assert copy_local.device.type == "cpu" and copy_local.data_ptr() != local.data_ptr(), (section, key)
            assert torch.equal(copy_local, local.cpu()), (section, key)


def test_torch_2_11s_copier_fails_on_the_state_and_dtgpts_stager_does_not(fp16_state, torch_2_11_copier):
    with pytest.raises(KeyError, match="<class 'type'>"):
        StateDictStager(pin_memory=False, share_memory=False).deepcopy_with_tensor_offload(fp16_state)
    assert_staged(build_stager(cuda=False).stage(fp16_state), fp16_state)


@pytest.mark.slow
def test_the_stager_copies_every_tensor_of_the_state_on_this_torch(fp16_state):
    assert_staged(build_stager(cuda=False).stage(fp16_state), fp16_state)
