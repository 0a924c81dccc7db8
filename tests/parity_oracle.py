"""The parity oracle: a run on some layout against the one-process run of the same config.

Per iteration the loss and the global gradient norm, and after the last one every parameter,
gathered whole by name. The loss alone is a weak witness: on the tiny model every step is
clipped and Adam is invariant to the scale of a gradient, so a norm counted 1.3x too large moves
10 iterations of losses by ~3.5e-7 relative, far under any useful tolerance; the norm itself
shows it at once, and the parameters show a rank that stepped differently from the others.

Each is compared at the losses' tolerance (fp32: relative 1e-5). The parameters are compared
tensor by tensor (relative Frobenius distance), except the attention's key bias: softmax ignores
it, so its exact gradient is 0 and its computed one is rounding noise, which Adam divides by its
own size into steps whose direction no reordering of a sum preserves. Measured after 10
iterations (tests/test_parity.py's model): the key bias differs from one process by up to
2.7e-4 relative (4.7e-6 absolute) on tp2 + SP, 1.2e-4 on dp2, 1.4e-4 on pp2, while every other
tensor is within 1.2e-6 and all parameters as one vector within 1e-6. So the key bias is held to
the bound only as part of that one vector.
"""

from __future__ import annotations

import pytest
import torch

RTOL = 1e-5


def without_key_bias(name: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The tensor, less the key rows of a fused QKV bias (laid out [head, (q|k|v), head_dim])."""
    if not name.endswith("attention.qkv.bias"):
        return tensor
    q_and_v = tensor.view(heads, 3, -1)[:, [0, 2]]
    return q_and_v.flatten()


def relative_distance(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def whole_distance(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over want's parameters as one vector (a pipeline's last stage
    may also store its copy of the tied embedding, under a name of its own)."""
    assert set(want) <= set(got), f"missing parameters: {sorted(set(want) - set(got))}"
    return relative_distance(torch.cat([got[k].flatten() for k in want]), torch.cat([want[k].flatten() for k in want]))


def assert_params_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], heads: int, rtol: float = RTOL) -> None:
    assert got.keys() == want.keys(), f"parameters differ by name: {sorted(got.keys() ^ want.keys())}"
    for name in want:
        distance = relative_distance(without_key_bias(name, got[name], heads), without_key_bias(name, want[name], heads))
        assert distance <= rtol, f"final {name} is off by {distance:.3g} (relative) from one process"
    whole = whole_distance(got, want)
    assert whole <= rtol, f"the final parameters as one vector are off by {whole:.3g} (relative) from one process"


def assert_same_training(got: dict, want: dict, iterations: int, rtol: float = RTOL, resumed_at: int = 0) -> None:
    """got and want as tests/runs.py train_run returns them; compares the first `iterations`
    iterations and the parameters after iteration `iterations` (both runs saved it). A run
    resumed from iteration `resumed_at`'s checkpoint logged only the iterations after it."""
    assert_same_figures(got, want, iterations, rtol, resumed_at)
    assert_params_match(got["params"][iterations], want["params"][iterations], want["heads"], rtol)


def assert_same_figures(got: dict, want: dict, iterations: int, rtol: float = RTOL, resumed_at: int = 0) -> None:
    """assert_same_training less the parameters: each iteration's losses, gradient norm and
    routing figures. For a run whose parameters are not well conditioned in its gradients: AdamW's
    first step from fresh moments moves an element by lr * g / (|g| + eps), whose slope in g is
    lr / eps where |g| is near eps, so an fp32 summation order of its gradient moves it by 1e4x."""
    assert len(got["loss"]) == iterations - resumed_at and iterations <= len(want["loss"])
    # An MoE run's router losses and routing counts are global figures too (dtgpt/moe/stats.py).
    losses = [k for k in ("load_balancing_loss", "seq_load_balancing_loss", "z_loss") if k in want]
    losses += [k for k in want if k.startswith("mtp_")]  # multi-token prediction's per-depth losses
    losses += [k for k in want if k.startswith("moe/")]  # each MoE layer's, with model.moe_per_layer_logging
    assert {k for k in got if k.startswith("moe/")} == {k for k in want if k.startswith("moe/")}
    for key in ("loss", "grad_norm", *losses):
        for it, (g, w) in enumerate(zip(got[key], want[key][resumed_at:iterations]), start=resumed_at + 1):
            assert g == pytest.approx(w, rel=rtol), f"iteration {it}: {key} {g} vs one-process {w}"
    for key in ("tokens_per_expert", "dropped_tokens"):
        if key in want:
            assert got[key] == want[key][resumed_at:iterations], f"{key} differs from one process"
