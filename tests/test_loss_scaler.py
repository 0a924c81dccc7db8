"""The fp16 loss scaler's state machine, unscaling and checkpoint state."""

import math

import pytest
import torch
import torch.distributed as dist

from dtgpt.config import Config, OptimizerConfig, TrainingConfig
from dtgpt.loss_scaler import LossScaler, build_loss_scaler

INF, NAN = float("inf"), float("nan")


def _dynamic(**kw):
    kw = {"initial_loss_scale": 1024.0, "min_loss_scale": 256.0, "loss_scale_window": 3, "hysteresis": 2, **kw}
    return LossScaler(OptimizerConfig(**kw))


def _state(s):
    return (s.scale, s.growth_tracker, s.hysteresis_tracker)


def test_dynamic_state_machine_hand_worked():
    s = _dynamic()
    assert _state(s) == (1024.0, 0, 2)
    # (found_inf, expected (scale, growth_tracker, hysteresis_tracker) after update)
    sequence = [
        (True, (1024.0, 0, 1)),  # first overflow: hysteresis absorbs it
        (False, (1024.0, 1, 1)),
        (False, (1024.0, 2, 1)),  # a clean stretch shorter than the window forgives nothing
        (True, (512.0, 0, 0)),  # second overflow halves the scale
        (True, (256.0, 0, -1)),  # once hysteresis is spent, every overflow halves
        (True, (256.0, 0, -2)),  # ...but never below min_loss_scale
        (False, (256.0, 1, -2)),
        (False, (256.0, 2, -2)),
        (False, (512.0, 0, 2)),  # window of clean iterations: double and refill hysteresis
        (True, (512.0, 0, 1)),  # so the next overflow is absorbed again
        (False, (512.0, 1, 1)),
        (True, (256.0, 0, 0)),  # and an overflow resets the growth count
    ]
    for i, (found_inf, expected) in enumerate(sequence):
        s.update(found_inf)
        assert _state(s) == expected, f"after update {i} ({found_inf=})"


def test_hysteresis_one_halves_at_once():
    s = _dynamic(hysteresis=1)
    s.update(True)
    assert s.scale == 512.0


def test_growth_is_unbounded_in_window_steps():
    s = _dynamic(loss_scale_window=2)
    for _ in range(6):
        s.update(False)
    assert s.scale == 1024.0 * 2**3


def test_static_and_disabled_never_change():
    static = LossScaler(OptimizerConfig(loss_scale=128.0))
    disabled = LossScaler(OptimizerConfig(), enabled=False)
    assert (static.kind, static.scale, disabled.kind, disabled.scale) == ("static", 128.0, "disabled", 1.0)
    for found_inf in (True, True, True, False, False):
        static.update(found_inf)
        disabled.update(found_inf)
    assert static.scale == 128.0 and disabled.scale == 1.0


def test_build_from_config_enables_for_fp16_only():
    fp16 = Config(training=TrainingConfig(fp16=True))
    bf16 = Config(training=TrainingConfig(bf16=True))
    assert build_loss_scaler(fp16).kind == "dynamic" and build_loss_scaler(fp16).scale == 2.0**32
    assert build_loss_scaler(bf16).kind == "disabled"


def test_unscale_finite_grads_exactly():
    s = _dynamic()
    values = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2).to(torch.float16)]
    grads = [v * 1024.0 for v in values]
    found_inf = s.unscale_and_check_(grads)
    assert found_inf.shape == () and found_inf.dtype == torch.float32 and found_inf.item() == 0.0
    for g, v in zip(grads, values):
        assert torch.equal(g, v)  # dividing by a power of two is exact


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_unscale_detects_non_finite(bad):
    s = _dynamic()
    grads = [torch.ones(4), torch.tensor([1.0, bad, 2.0]), torch.ones(3)]
    assert s.unscale_and_check_(grads).item() == 1.0
    assert grads[0][0].item() == 1.0 / 1024.0  # the finite ones are still unscaled


@pytest.mark.parametrize("enabled", [True, False])
def test_static_and_disabled_still_check(enabled):
    s = LossScaler(OptimizerConfig(loss_scale=4.0), enabled=enabled)
    grads = [torch.tensor([8.0, 4.0])]
    assert s.unscale_and_check_(grads).item() == 0.0
    assert grads[0].tolist() == ([2.0, 1.0] if enabled else [8.0, 4.0])
    assert s.unscale_and_check_([torch.tensor([NAN])]).item() == 1.0


def test_unscale_no_grads():
    assert _dynamic().unscale_and_check_([]).item() == 0.0


def test_unscale_dtensor_grads():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, DTensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.tensor([2048.0, -1024.0])
        grad = DTensor.from_local(local, mesh, [Replicate()])
        s = _dynamic()
        assert s.unscale_and_check_([grad]).item() == 0.0
        assert grad.to_local().tolist() == [2.0, -1.0]
        bad = DTensor.from_local(torch.tensor([INF]), mesh, [Replicate()])
        assert s.unscale_and_check_([grad, bad]).item() == 1.0
    finally:
        dist.destroy_process_group()


def test_state_dict_round_trip_resumes_the_same_sequence():
    s = _dynamic()
    for found_inf in (True, False, False):
        s.update(found_inf)
    resumed = _dynamic(initial_loss_scale=2.0**32)
    resumed.load_state_dict(s.state_dict())
    assert _state(resumed) == _state(s) == (1024.0, 2, 1)
    for found_inf in (False, True, True, False):
        s.update(found_inf)
        resumed.update(found_inf)
        assert _state(resumed) == _state(s)


def test_state_from_another_kind_is_ignored():
    dynamic = _dynamic()
    dynamic.load_state_dict(LossScaler(OptimizerConfig(), enabled=False).state_dict())
    assert _state(dynamic) == (1024.0, 0, 2)  # not the bf16 run's scale of 1
    static = LossScaler(OptimizerConfig(loss_scale=8.0))
    static.load_state_dict(_dynamic().state_dict())
    assert static.scale == 8.0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp

    s = _dynamic()
    for found_inf in (True, True, False):
        s.update(found_inf)
    dcp.save({"loss_scaler": s}, checkpoint_id=str(tmp_path))
    resumed = _dynamic()
    dcp.load({"loss_scaler": resumed}, checkpoint_id=str(tmp_path))
    assert _state(resumed) == (512.0, 1, 0)
    assert math.isclose(resumed.scale, s.scale)
