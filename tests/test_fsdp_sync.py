"""set_micro_batch_sync (dtgpt/parallel/fsdp.py): FSDP's units get the state each micro-batch's
backward needs (gradients reduced and parameters resharded after the last one only), and the
setters, each a walk over every module of the part, run only when that state changes."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dtgpt.parallel.fsdp import set_micro_batch_sync


def test_the_units_state_is_set_only_when_it_changes(monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        calls = []
        for setter in ("set_is_last_backward", "set_requires_gradient_sync", "set_reshard_after_backward"):
            real = getattr(model, setter)
            monkeypatch.setattr(model, setter, lambda value, real=real, setter=setter: (calls.append((setter, value)), real(value)))

        def iteration(micro_batches: int, reshard: bool = False) -> list:
            calls.clear()
            for i in range(micro_batches):
                set_micro_batch_sync(model, last=i == micro_batches - 1, reshard_every_micro_batch=reshard)
            return [value for _, value in calls]

        assert iteration(1) == []  # FSDP's default is the last micro-batch's state
        assert iteration(3) == [False, False, False, True, True, True]  # before the first, before the last
        assert iteration(1) == []
        assert iteration(4, reshard=True) == [False, False, True, True, True, True]  # resharded after each
    finally:
        dist.destroy_process_group()
