"""The torch names dtgpt's CUDA-only paths call exist in the torch this runs on: a CPU run never
reaches those paths, so a name missing from a supported torch (2.11, the floor, is what the GPU
machines run) would fail only on a GPU. Run on 2.11 by `make test-torch-floor`. Also checked here,
on the CPU, the device-agnostic part of two CUDA paths: the fused AdamW kernel over DTensor
parameters, and the varlen kernel's signature form."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtgpt import varlen_kernel
from dtgpt.config import OptimizerConfig
from dtgpt.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("dtgpt/**/*.py"), *REPO.glob("scripts/*.py")])
# torch.cuda.*, torch._private_op, torch.ops.aten.*, torch.nn.attention.*, torch.profiler.*: the
# names a CUDA-only path calls, in code or named in a comment as what the code calls.
NAME = re.compile(r"\btorch\.(?:cuda\.[\w.]+|_[A-Za-z]\w*(?:\.\w+)*|ops\.aten\.\w+|nn\.attention\.[\w.]+|profiler\.\w+)")
# Imported by name inside functions (only reached on CUDA).
IMPORTED = ["torch.nn.attention.varlen.varlen_attn", "torch.autograd.profiler_util.FunctionEvent.device_time_total"]


def _resolve(dotted: str) -> bool:
    """Whether `dotted` names something in this torch: the longest importable module, then attributes."""
    parts = dotted.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_torch_name_on_a_cuda_path_exists_in_this_torch():
    names = {m.group(0).rstrip(".") for path in SOURCES for m in NAME.finditer(path.read_text())}
    assert {"torch.cuda.get_rng_state", "torch._foreach_norm", "torch.cuda.memory._record_memory_history"} <= names  # the scan sees them
    missing = sorted(n for n in [*names, *IMPORTED] if not _resolve(n))
    assert missing == [], f"torch {torch.__version__} has no {missing}"


def test_the_varlen_kernel_recognises_this_torchs_signature():
    """On 2.11: window_size=(-1, 0) for causal and a scale, no enable_gqa (flash takes fewer
    key/value heads as they come); a form it did not recognise would fall back to the mask."""
    varlen_kernel._torch_kernel.cache_clear()
    assert varlen_kernel._torch_kernel() is not None


def test_the_varlen_kernel_reaches_torchs_op_causal_with_its_scale(monkeypatch):
    """What dtgpt's kernel hands torch's varlen op on this torch, with GQA heads: causal (2.11 and
    2.13 read it off window_size == (-1, 0), a tuple; a list would silently mean full attention)
    and the softmax scale; the op itself is flash's, CUDA only, so a spy stands in for it."""
    varlen_kernel._torch_kernel.cache_clear()
    kernel = varlen_kernel._torch_kernel()
    calls = []

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, window_size, *rest):
        calls.append((is_causal, scale, list(window_size), k.shape[1]))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2)

    getattr(torch.ops.torch_attn, "_varlen_attn")  # resolved once, so there is an attribute to replace
    monkeypatch.setattr(torch.ops.torch_attn, "_varlen_attn", spy)
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = kernel(q, kv, kv, cu, cu, 4, 4, scale=0.125)
    assert out.shape == q.shape and calls == [(True, 0.125, [-1, 0], 2)]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_fused_optimizer_over_dtensor_parameters_equals_the_foreach_kernel(optimizer):
    """build_optimizer(fused=True) is what a CUDA run builds; DTensor's rule for the fused kernel
    and the kernel itself run on the CPU too, so a torch without them fails here. SGD runs its
    foreach kernels then (DTensor has no rule for torch's fused SGD): a run under FSDP or TP steps."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        full = {"w.weight": torch.randn(8, 4), "w.bias": torch.randn(4)}
        results = []
        for fused in (False, True):
            params = {n: torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for n, t in full.items()}
            built = build_optimizer(params.items(), OptimizerConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1), fused=fused)
            for i in range(3):
                for p in params.values():
                    p.grad = torch.full_like(p, 0.5 + i) * p.detach().sign()
                built.step()
            results.append([p.full_tensor() for p in params.values()])
        for foreach, fused in zip(*results):
            torch.testing.assert_close(fused, foreach)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dotted, there", [("torch.cuda.get_rng_state", True), ("torch.cuda.no_such_name", False), ("torch._no_such_op", False)])
def test_the_resolver_tells_a_missing_name(dotted, there):
    assert _resolve(dotted) is there
