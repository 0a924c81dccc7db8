"""Count the host synchronisations a piece of code would make on a GPU, on any machine.

A host sync is a call that needs a tensor's value on the host: on a GPU it waits for every kernel
queued before it. On CPU nothing waits, so the probe counts the calls themselves:

- the ops that read a value (seen by a TorchDispatchMode): `_local_scalar_dense` (what `item()`,
  a tensor's `bool`/`int`/`float` and `if tensor:` call), `nonzero` (its size is the data's),
  `masked_select` and boolean-mask indexing (a `nonzero` inside), `repeat_interleave` of a
  tensor of repeats without `output_size`, `unique*` and `bincount` (their sizes, or their
  maximum, are read);
- the Python methods that copy to the host without an op the mode sees on CPU: `tolist()`,
  `numpy()`, `cpu()` and `.to("cpu")` (the string; a torch.device naming the CPU counts only
  for a tensor on another device, as a run's own device is the CPU here).

    with SyncProbe() as probe:
        forward_backward(model, batch, num_microbatches)
    assert probe.count == 1, probe.calls   # the loss

A DeviceMesh's bookkeeping on its mesh tensor (always on the CPU, whatever the device: slicing a
sub-mesh reads it) is no device sync and is not counted.

`probe.calls` lists each counted call by name, so a failing test says what synced.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_VALUE_OPS = {
    aten._local_scalar_dense.default: "item/bool/int/float",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.bincount.default: "bincount",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.unique_dim.default: "unique_dim",
}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_HOST_METHODS = ("tolist", "numpy", "cpu")


def _to_host(tensor: torch.Tensor, value) -> bool:
    """Whether `.to(value)` copies `tensor` to the host: "cpu" spelled out in the code counts on
    every machine; a torch.device (a run's own device, which is the CPU here) only off the CPU."""
    if isinstance(value, str):
        return value.split(":")[0] == "cpu"
    return isinstance(value, torch.device) and value.type == "cpu" and tensor.device.type != "cpu"


def _in_device_mesh() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith("device_mesh.py"):
            return True
        frame = frame.f_back
    return False


class SyncProbe(TorchDispatchMode):
    """A context manager counting host syncs (module docstring) in `count`, named in `calls`."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self._saved: dict[str, object] = {}

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _in_device_mesh():
            pass
        elif func in _VALUE_OPS:
            self.calls.append(_VALUE_OPS[func])
        elif func in _REPEAT_INTERLEAVE and kwargs.get("output_size", args[-1] if len(args) > 2 else None) is None:
            self.calls.append("repeat_interleave without output_size")
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.calls.append("boolean-mask index")
        return func(*args, **kwargs)

    def __enter__(self):
        for name in _HOST_METHODS + ("to",):
            self._saved[name] = getattr(torch.Tensor, name)
        calls, saved = self.calls, self._saved

        def counted(name):
            def method(tensor, *args, **kwargs):
                if not _in_device_mesh():
                    calls.append(name)
                return saved[name](tensor, *args, **kwargs)

            return method

        def to(tensor, *args, **kwargs):
            if (any(_to_host(tensor, a) for a in args) or _to_host(tensor, kwargs.get("device"))) and not _in_device_mesh():
                calls.append("to('cpu')")
            return saved["to"](tensor, *args, **kwargs)

        for name in _HOST_METHODS:
            setattr(torch.Tensor, name, counted(name))
        torch.Tensor.to = to
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, method in self._saved.items():
                setattr(torch.Tensor, name, method)
