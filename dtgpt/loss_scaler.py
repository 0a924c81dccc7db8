"""The fp16 loss scaler: Megatron's dynamic scale with hysteresis, or a static scale.

One object serves every precision: under bf16 / fp32 it is built disabled (scale 1, never
changes), so the trainer runs the same scale -> backward -> unscale-and-check -> update path.
The scale itself is applied in the loss (dtgpt.parallel.model_parts.GlobalBatchLoss).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from dtgpt.config import Config, OptimizerConfig

GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5


class LossScaler(Stateful):
    """Scale the loss before backward, unscale the grads after, and adapt the scale.

    Three kinds, chosen at construction:
    - disabled (enabled=False): scale 1 forever; grads are still checked for inf/nan.
    - static (cfg.loss_scale set): that scale forever; an overflowing iteration is still skipped.
    - dynamic: starts at cfg.initial_loss_scale. After `hysteresis` overflowing iterations
      (not necessarily in a row) the scale halves, never below cfg.min_loss_scale; after
      cfg.loss_scale_window clean iterations in a row it doubles, and only then is the
      hysteresis budget refilled (Megatron's rule: a clean stretch shorter than the window
      does not forgive earlier overflows).
    """

    def __init__(self, cfg: OptimizerConfig, *, enabled: bool = True):
        self.enabled = enabled
        self.dynamic = enabled and cfg.loss_scale is None
        if not enabled:
            initial = 1.0
        elif cfg.loss_scale is not None:
            initial = float(cfg.loss_scale)
        else:
            initial = float(cfg.initial_loss_scale)
        if initial <= 0:
            raise ValueError(f"loss scale {initial} must be > 0 (optimizer.loss_scale / initial_loss_scale)")
        self.min_scale = float(cfg.min_loss_scale)
        self.window = cfg.loss_scale_window
        self.hysteresis = cfg.hysteresis
        self.scale = initial
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @property
    def kind(self) -> str:
        return "dynamic" if self.dynamic else ("static" if self.enabled else "disabled")

    def unscale_and_check_(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide the grads by the scale in place; return found_inf (0-dim float32, 1.0 or 0.0).

        Nothing here waits on the device: the flag stays a tensor. Each rank sees only its own
        shards (DTensor grads are handled through their local tensors): the flag is this rank's
        alone. (dtgpt.step reads the global overflow from the global gradient norm instead,
        which a non-finite gradient on any rank makes non-finite.)
        The multiply happens even when a grad is non-finite; those grads are then discarded.
        """
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        locals_ = [g for g in locals_ if g.numel() > 0]
        if not locals_:
            return torch.zeros((), dtype=torch.float32)
        # The fused kernel takes one device per call; grouping by dtype too keeps it on its fast path.
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for g in locals_:
            buckets[(g.device, g.dtype)].append(g)
        found: dict[torch.device, torch.Tensor] = {}
        inv_scale: dict[torch.device, torch.Tensor] = {}
        for (device, _dtype), tensors in buckets.items():
            if device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                inv_scale[device] = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv_scale[device])
        flags = list(found.values())
        result = flags[0]
        for other in flags[1:]:
            result = torch.maximum(result, other.to(result.device))
        return result

    def update(self, found_inf: bool) -> None:
        """Advance the state machine after one iteration (a no-op unless dynamic)."""
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * BACKOFF_FACTOR, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= GROWTH_FACTOR

    def state_dict(self) -> dict[str, Any]:
        # The same keys for every kind, so a checkpoint from a bf16 run loads into an fp16 run.
        return {
            "kind": self.kind,
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the dynamic state. A static or disabled scaler keeps its configured scale, and a
        dynamic one ignores a state saved by another kind (its scale of 1 or the old static value
        would be a bad place to restart fp16 from)."""
        if not self.dynamic or state_dict.get("kind") != "dynamic":
            return
        self.scale = float(state_dict["scale"])
        self.growth_tracker = int(state_dict["growth_tracker"])
        self.hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def build_loss_scaler(cfg: Config) -> LossScaler:
    """Enabled for fp16 only: bf16 and fp32 have the range to do without."""
    return LossScaler(cfg.optimizer, enabled=cfg.training.fp16)
