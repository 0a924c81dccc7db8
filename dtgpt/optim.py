"""AdamW, SGD or Muon (dtgpt/muon.py) with weight-decay groups and the learning-rate schedule (the
batch-size schedules are dtgpt/config/batch_schedule.py).

Every length here is counted in samples, as Megatron's OptimizerParamScheduler counts them when
it trains by samples: an iteration-denominated key (lr_decay_iters, lr_warmup_iters, ...) is
turned into samples by multiplying with the final global_batch_size, once, at construction.
See docs/schedules.md for the definitions and where dtgpt deliberately differs from Megatron.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from dtgpt.config import Config, OptimizerConfig, get_key
from dtgpt.config.decoupled_lr_rules import embedding_output_bounds
from dtgpt.config.derived import lr_decay_length, lr_warmup_length, lr_wsd_decay_length, wd_incr_length, weight_decay_bounds
from dtgpt.decoupled_lr import DECOUPLED, decoupled_group, is_embedding_or_output
from dtgpt.muon import MUON, MuonMatrices, MuonWithAdamW, is_muon_matrix, muon_matrices

# ---------------------------------------------------------------------------------------------
# AdamW


def build_optimizer(
    named_params: Iterable[tuple[str, nn.Parameter]],
    cfg: OptimizerConfig,
    *,
    fused: bool = False,
    matrices: MuonMatrices | None = None,
) -> torch.optim.Optimizer:
    """optimizer.optimizer's torch optimizer (AdamW, SGD or Muon) with up to four groups: matrices decay,
    biases and norm weights do not (`decays`); under optimizer.decoupled_lr a third holds the word
    embedding and the output layer; under muon a fourth, marked MUON, takes the matrices Megatron
    gives Muon (`matrices`: how they make Megatron's, dtgpt.muon.muon_matrices). Each group carries
    Megatron's `wd_mult` (1.0 decays, 0.0 does not), which says its role.

    Parameters may be DTensors (FSDP2 / TP shards); the optimizers' kernels handle them as they are.
    A parameter seen twice (tied embedding and output weight) is kept once, by identity, so it
    is stepped once. Frozen parameters (requires_grad=False) are left out.
    Only non-empty groups are built: torch's flattened optimizer state dict (the checkpoint's)
    cannot load into an empty group, and a pipeline stage may hold no parameter of a group (the
    embedding alone has no bias or norm). Nothing depends on a group's position: checkpoints key
    the optimizer state by parameter name and store no groups. `fused` (CUDA) runs AdamW's one
    kernel per step; otherwise (and for SGD) the multi-tensor (foreach) kernels.
    """
    seen: set[int] = set()
    muon: list[nn.Parameter] = []  # under optimizer.optimizer = "muon": its matrices (dtgpt/muon.py)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    embedding_output: list[nn.Parameter] = []  # their own group under decoupled_lr (dtgpt/decoupled_lr.py)
    for name, param in named_params:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if cfg.uses_muon and is_muon_matrix(name, param):
            muon.append(param)
        elif cfg.decoupled_lr is not None and is_embedding_or_output(name):
            embedding_output.append(param)
        elif decays(name, param, apply_wd_to_qk_layernorm=cfg.apply_wd_to_qk_layernorm):
            decay.append(param)
        else:
            no_decay.append(param)
    if not seen:
        raise ValueError("build_optimizer got no trainable parameters")
    groups = [
        {"params": muon, "weight_decay": cfg.weight_decay, WD_MULT: 1.0, MUON: True},
        {"params": decay, "weight_decay": cfg.weight_decay, WD_MULT: 1.0},
        {"params": no_decay, "weight_decay": 0.0, WD_MULT: 0.0},
        decoupled_group(embedding_output, cfg.weight_decay) | {WD_MULT: 1.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer == "sgd":
        # Megatron's sgd: torch's SGD with its default dampening 0 and nesterov False, the weight
        # decay added to the gradient before the momentum (not decoupled as AdamW's). Always the
        # foreach kernels: DTensor has no sharding rule for torch's fused SGD (torch 2.13), and
        # SGD is one multiply-add per tensor (tests/test_torch_cuda_apis.py)
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay, foreach=True)
    adamw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                 foreach=not fused, fused=fused)  # fmt: skip
    if cfg.uses_muon:  # AdamW for every group but MUON's
        return MuonWithAdamW(groups, muon=cfg, matrices=matrices or MuonMatrices({}, {}), **adamw)
    return torch.optim.AdamW(groups, **adamw)


WD_MULT = "wd_mult"
"""The param-group key, Megatron's name, scaling optimizer.weight_decay: 1.0 for the groups that decay, 0.0 else."""

QK_LAYERNORM = (".q_norm.", ".k_norm.")
"""What marks the query and key norms' parameters for apply_wd_to_qk_layernorm: Megatron matches
its names `q_layernorm.` and `k_layernorm.`, dtgpt's attention q_norm and k_norm (multi-token
prediction's blocks too). Multi-latent attention's norms are refused with it
(dtgpt/config/weight_decay_rules.py)."""


def decays(name: str, param: torch.Tensor, *, apply_wd_to_qk_layernorm: bool = False) -> bool:
    """Megatron's rule: weight decay for every parameter but the biases and the norm weights;
    with apply_wd_to_qk_layernorm (Megatron's --apply-wd-to-qk-layernorm), the query and key
    norms' weights and biases decay too.

    Decided by role, not by shape alone: a bias is named so (`.bias`, or the stacked experts'
    `fc1_bias` of shape (E, n), one bias per expert, which a shape rule would decay), a norm
    weight is the only other 1-D parameter."""
    if apply_wd_to_qk_layernorm and any(mark in f".{name}" for mark in QK_LAYERNORM):
        return True
    return not (name.endswith("bias") or param.ndim < 2)


class PartOptimizers:
    """One optimizer (AdamW or SGD) per model part (one per pipeline stage a rank holds).

    Each optimizer's state is then keyed by its own part's parameter names, which are the
    whole model's names whatever the pipeline split, so optimizer checkpoints are mesh-free.
    Behaves like one optimizer for the trainer: step, zero_grad, param_groups.
    """

    def __init__(self, parts: list[nn.Module], cfg: OptimizerConfig, *, fused: bool = False):
        self.optimizers = [build_optimizer(p.named_parameters(), cfg, fused=fused, matrices=muon_matrices(p)) for p in parts]

    @classmethod
    def wrap(cls, optimizers: list[torch.optim.Optimizer]) -> "PartOptimizers":
        """Use optimizers built elsewhere (one per model part), e.g. a library user's own Adam."""
        obj = cls.__new__(cls)
        obj.optimizers = list(optimizers)
        return obj

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule

_WSD_COEFF = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
    "exponential": lambda r: 2.0 * 0.5**r - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}


class LRSchedule(Stateful):
    """Megatron's learning-rate and weight-decay schedule (its OptimizerParamScheduler) over
    samples consumed by successful iterations.

    Its only state is that sample count: the lengths come from the config, so a resumed run
    may change them (as Megatron's --override-opt_param-scheduler would), and the count alone
    resumes the same lr and weight decay on any mesh. Skipped iterations (fp16 overflow,
    non-finite loss) do not advance it, as in Megatron.
    """

    def __init__(self, cfg: Config):
        o = cfg.optimizer  # validated: warmup < decay, and the WSD anneal fits between them
        self.style, self.wsd_style = o.lr_decay_style, o.lr_wsd_decay_style
        self.max_lr, self.min_lr, self.init_lr = o.lr, o.min_lr, o.lr_warmup_init
        # The (peak, minimum) of the groups marked DECOUPLED: the word embedding and output layer.
        self.decoupled = embedding_output_bounds(o) if o.decoupled_lr is not None else None
        self.decay_steps = lr_decay_length(cfg).samples
        self.warmup_steps = lr_warmup_length(cfg).samples
        self.wsd_decay_steps = lr_wsd_decay_length(cfg).samples if self.style == "WSD" else 0
        self.start_wd, self.end_wd = weight_decay_bounds(cfg)
        self.wd_incr_style, self.wd_incr_steps = o.weight_decay_incr_style, wd_incr_length(cfg).samples
        self.num_samples = 0

    def lr_at(self, num_samples: float, bounds: tuple[float, float] | None = None) -> float:
        """The learning rate after `num_samples` samples of successful iterations, between
        `bounds` (peak, minimum) if given (a decoupled group's), else max_lr and min_lr."""
        max_lr, min_lr = bounds or (self.max_lr, self.min_lr)
        if self.warmup_steps > 0 and num_samples <= self.warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * num_samples / self.warmup_steps
        if self.style == "constant":
            return max_lr
        if num_samples > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            warmup, n = max(self.warmup_steps, 1), max(num_samples, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(n))
        if self.style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if num_samples <= anneal_start:
                coeff = 1.0
            else:
                r = (num_samples - anneal_start) / self.wsd_decay_steps
                coeff = _WSD_COEFF[self.wsd_style](r)
        else:
            ratio = (num_samples - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
            coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def wd_at(self, num_samples: float) -> float:
        """The weight decay after `num_samples` samples (of the groups that decay, WD_MULT 1):
        from start_wd up to end_wd over the run, then end_wd."""
        if num_samples > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = num_samples / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    @property
    def current_lr(self) -> float:
        return self.lr_at(self.num_samples)

    @property
    def current_wd(self) -> float:
        return self.wd_at(self.num_samples)

    def step(self, increment_samples: int) -> None:
        """Count the samples of one successful iteration."""
        if increment_samples < 0:
            raise ValueError(f"increment_samples={increment_samples} must be >= 0")
        self.num_samples += increment_samples

    def apply(self, optimizer: torch.optim.Optimizer) -> float:
        """Set every group's lr, and the weight decay of each group marked WD_MULT (all of
        build_optimizer's) to current_wd x WD_MULT, as Megatron's scheduler sets them (call before
        optimizer.step); returns current_lr, the LR of every group but the embedding-and-output
        one of decoupled_lr. A library user's own groups keep their weight decay."""
        lr, wd = self.current_lr, self.current_wd
        decoupled = self.lr_at(self.num_samples, self.decoupled) if self.decoupled is not None else lr
        for group in optimizer.param_groups:
            if WD_MULT in group:
                group["weight_decay"] = wd * group[WD_MULT]
            group_lr = decoupled if group.get(DECOUPLED) else lr
            if isinstance(group["lr"], torch.Tensor):  # a tensor lr (capturable / compiled step) stays one
                group["lr"].fill_(group_lr)
            else:
                group["lr"] = group_lr
        return lr

    def state_dict(self) -> dict[str, int]:
        return {"num_samples": self.num_samples}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.num_samples = int(state_dict["num_samples"])


SCHEDULE_KEYS = (
    "optimizer.lr", "optimizer.min_lr", "optimizer.decoupled_lr", "optimizer.decoupled_min_lr", "optimizer.lr_decay_style", "optimizer.lr_decay_iters",
    "optimizer.lr_decay_samples", "optimizer.lr_warmup_fraction", "optimizer.lr_warmup_iters",
    "optimizer.lr_warmup_samples", "optimizer.lr_warmup_init", "optimizer.lr_wsd_decay_style",
    "optimizer.lr_wsd_decay_iters", "optimizer.lr_wsd_decay_samples", "training.train_iters",
    "training.train_samples", "training.global_batch_size", "optimizer.weight_decay", "optimizer.start_weight_decay",
    "optimizer.end_weight_decay", "optimizer.weight_decay_incr_style",
)  # fmt: skip
"""The keys the LR and weight-decay schedule is made of (its lengths count samples of the final global batch)."""


def schedule_change(saved: Config | None, cfg: Config, num_samples: int) -> str | None:
    """One line when a resumed run's LR schedule is not the one its checkpoint was trained with:
    which keys changed, and the LR at this point under each (the config's is used, as Megatron's
    --override-opt_param-scheduler would). None when nothing changed or the saved config is unknown."""
    if saved is None:
        return None
    changed = [f"{key} {get_key(saved, key)} -> {get_key(cfg, key)}" for key in SCHEDULE_KEYS if get_key(saved, key) != get_key(cfg, key)]
    if not changed:
        return None
    before, now = LRSchedule(saved), LRSchedule(cfg)
    wd = "" if before.wd_at(num_samples) == now.wd_at(num_samples) else (
        f"; the weight decay is {now.wd_at(num_samples):.3e} (the checkpoint's schedule: {before.wd_at(num_samples):.3e})")
    return (
        f"the LR schedule differs from the checkpoint's ({', '.join(changed)}): this run follows its config's, so "
        f"the LR after {num_samples} samples is {now.lr_at(num_samples):.3e} (the checkpoint's schedule: "
        f"{before.lr_at(num_samples):.3e}){wd}"
    )

