"""Async saves copy dtgpt's state with torch's own stager, save after save, on every torch dtgpt
accepts (dtgpt/checkpoint/staging.py): torch 2.11's DefaultStager closes its copier after each
copy, and a closed copier cannot copy dtgpt's state again."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from dtgpt import shutdown
from dtgpt.checkpoint.staging import build_stager, stager_for_next_save
from tests.checkpoints import make_trainer, step


@pytest.fixture
def state():
    """The state an async save hands the stager where the weights are DTensors (every multi-rank
    run): a fp16 run's state, its model weights made DTensors on a mesh of one."""
    trainer = make_trainer("--training.fp16=true")
    step(trainer)
    state = trainer.state.state_dict()
    if not dist.is_initialized():  # one process: plain fp32 masters, no process group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    state["model"] = {k: DTensor.from_local(v.clone(), mesh, [Replicate()]) for k, v in state["model"].items()}
    yield state
    shutdown()


@pytest.fixture
def torch_2_11_stager(monkeypatch):
    """DefaultStager as torch 2.11 ships it: its copier is closed after every copy."""
    stage = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)


def assert_staged(staged: dict, state: dict) -> None:
    for section, values in state.items():
        for key, value in values.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            copy = staged[section][key].to_local() if isinstance(value, DTensor) else staged[section][key]
            assert copy.device.type == "cpu" and copy.data_ptr() != local.data_ptr(), (section, key)
            assert torch.equal(copy, local.cpu()), (section, key)


def test_a_closed_stager_is_replaced_before_the_next_save(state, torch_2_11_stager):
    stager = build_stager(cuda=False)
    assert_staged(stager.stage(state), state)
    with pytest.raises(KeyError, match="<class 'type'>"):
        stager.stage(state)  # what reusing it did on torch 2.11
    stager = None
    for _save in range(2):
        stager = stager_for_next_save(stager, cuda=False)
        assert_staged(stager.stage(state), state)


@pytest.mark.slow
def test_an_open_stager_is_kept_from_save_to_save(state):
    first = stager_for_next_save(None, cuda=False)
    assert_staged(first.stage(state), state)
    kept = stager_for_next_save(first, cuda=False)
    if torch.__version__ >= (2, 13):  # keeps its copier open: the CPU buffers are reused
        assert kept is first
    assert_staged(kept.stage(state), state)
