"""megatron-core's own schedule objects as the oracle: the fp16 loss scale, the learning rate, the
weight decay and the batch-size ramp-up, compared step by step with dtgpt's.

Each Megatron object is built directly, in this process, without a process group:
DynamicGradScaler (megatron.core.optimizer.grad_scaler), OptimizerParamScheduler
(megatron.core.optimizer_param_scheduler, on a stand-in optimizer that is only a list of param
groups, all it touches) and RampupBatchsizeNumMicroBatchesCalculator
(megatron.core.num_microbatches_calculator). The one CPU patch: DynamicGradScaler makes its
tensors on "cuda", so the fixture lets its module's torch.tensor ignore the device.

megatron-core 0.17 removed the ramp-up calculator (StepBatchsizeNumMicroBatchesCalculator took its
place), so it comes from megatron-core 0.16.1: the venv's own below Python 3.12, else the copy
`make setup` installs apart in .oracle/mcore-0.16.1 (see rampup_calculator).
"""

from __future__ import annotations

import importlib.util
import itertools
import random
import types
import warnings
from pathlib import Path

import pytest
import torch

with warnings.catch_warnings():
    # On import megatron-core says that its GPU kernels (Transformer Engine, Apex) are absent and
    # that some of its own imports are deprecated: expected of a CPU oracle, and not ours.
    warnings.simplefilter("ignore")
    from megatron.core import num_microbatches_calculator, optimizer_param_scheduler
    from megatron.core.optimizer import grad_scaler

from dtgpt.config import Config, OptimizerConfig, TrainingConfig, num_microbatches
from dtgpt.loss_scaler import BACKOFF_FACTOR, GROWTH_FACTOR, LossScaler
from dtgpt.config.batch_schedule import BatchSizeSchedule
from dtgpt.optim import WD_MULT, LRSchedule, build_optimizer

# -- loss scale --------------------------------------------------------------------------------


@pytest.fixture
def megatron_scaler(monkeypatch):
    """DynamicGradScaler on CPU: its module's torch, with torch.tensor ignoring device="cuda"."""
    on_cpu = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    on_cpu.tensor = lambda data, device=None, **kwargs: torch.tensor(data, **kwargs)
    monkeypatch.setattr(grad_scaler, "torch", on_cpu)

    def build(cfg: OptimizerConfig):
        return grad_scaler.DynamicGradScaler(
            initial_scale=cfg.initial_loss_scale, min_scale=cfg.min_loss_scale, growth_factor=GROWTH_FACTOR,
            backoff_factor=BACKOFF_FACTOR, growth_interval=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
        )  # fmt: skip

    return build


def overflow_pattern(seed: int, n: int) -> list[bool]:
    """Overflows in bursts and clean stretches of random lengths (some longer than the window)."""
    rng = random.Random(seed)
    flags: list[bool] = []
    while len(flags) < n:
        flags += [rng.random() < 0.5] * rng.choice((1, 1, 2, 3, 5, 9))
    return flags[:n]


@pytest.mark.parametrize("window, hysteresis", [(1, 1), (3, 2), (4, 3), (8, 1)])
def test_loss_scale_follows_megatron_dynamic_grad_scaler(megatron_scaler, window, hysteresis):
    """The scale and both trackers after each of 400 iterations, overflowing or not; the scale
    reaches its floor (min_loss_scale) and grows back."""
    cfg = OptimizerConfig(initial_loss_scale=2.0**10, min_loss_scale=2.0**4, loss_scale_window=window, hysteresis=hysteresis)
    ours, theirs = LossScaler(cfg), megatron_scaler(cfg)
    scales = set()
    for i, found_inf in enumerate(overflow_pattern(window * 10 + hysteresis, 400)):
        ours.update(found_inf)
        theirs.update(found_inf)
        expected = (theirs.scale.item(), theirs.state_dict()["growth_tracker"], theirs.state_dict()["hysteresis_tracker"])
        assert (ours.scale, ours.growth_tracker, ours.hysteresis_tracker) == expected, i
        scales.add(ours.scale)
    assert cfg.min_loss_scale in scales and max(scales) > cfg.min_loss_scale


# -- learning rate -----------------------------------------------------------------------------


def megatron_lengths(cfg: Config) -> dict:
    """The scheduler's lengths in samples as Megatron-LM's get_optimizer_param_scheduler gives
    them: the *_samples keys as they are, *_iters keys times global_batch_size, a warmup
    fraction of the decay."""
    o, gbs = cfg.optimizer, cfg.training.global_batch_size
    decay = o.lr_decay_samples or (o.lr_decay_iters or cfg.training.train_iters) * gbs
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    else:
        warmup = o.lr_warmup_samples or o.lr_warmup_iters * gbs
    wsd = o.lr_wsd_decay_samples or (o.lr_wsd_decay_iters * gbs if o.lr_wsd_decay_iters else None)
    return dict(lr_warmup_steps=warmup, lr_decay_steps=decay, wsd_decay_steps=wsd)


LR_SCHEDULES = {
    "linear": dict(lr_decay_style="linear", lr_warmup_samples=64, lr_decay_samples=1024),
    "cosine": dict(lr_decay_style="cosine", lr_warmup_init=1e-4, lr_warmup_fraction=0.1, lr_decay_iters=100),
    "cosine_iters": dict(lr_decay_style="cosine", lr_warmup_iters=6),  # decay: train_iters
    "inverse_sqrt": dict(lr_decay_style="inverse-square-root", lr_warmup_samples=80, lr_decay_samples=1000),
    "constant": dict(lr_decay_style="constant", lr_warmup_samples=40),
    **{f"wsd_{style}": dict(lr_decay_style="WSD", lr_wsd_decay_style=style, lr_warmup_samples=64, lr_decay_samples=1024,
                            lr_wsd_decay_iters=30) for style in ("linear", "cosine", "exponential", "minus_sqrt")},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LR_SCHEDULES))
def test_learning_rate_follows_megatron_optimizer_param_scheduler(name):
    """Both count samples of successful iterations; stepped by the same uneven increments (so
    they land on and beside the end of warmup, the anneal start and the end of decay), the
    rates agree at every step, past the end of decay too."""
    cfg = Config(
        training=TrainingConfig(global_batch_size=8, train_iters=120),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, **LR_SCHEDULES[name]),
    )
    ours = LRSchedule(cfg)
    o = cfg.optimizer
    holder = types.SimpleNamespace(param_groups=[{}])
    theirs = optimizer_param_scheduler.OptimizerParamScheduler(
        holder, init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        lr_wsd_decay_style=o.lr_wsd_decay_style, **megatron_lengths(cfg),
    )  # fmt: skip
    assert ours.current_lr == holder.param_groups[0]["lr"]
    for step, increment in enumerate(itertools.islice(itertools.cycle((8, 8, 7, 16, 1, 8)), 200)):
        ours.step(increment)
        theirs.step(increment)
        assert ours.current_lr == pytest.approx(holder.param_groups[0]["lr"], rel=1e-12, abs=0), (step, ours.num_samples)
    assert ours.num_samples > megatron_lengths(cfg)["lr_decay_steps"]


# -- weight decay ------------------------------------------------------------------------------


def megatron_weight_decay(cfg: Config) -> dict:
    """The scheduler's weight-decay arguments as Megatron-LM gives them: arguments.py sets start
    and end to --weight-decay under 'constant'; get_optimizer_param_scheduler increments over
    the whole run (train_samples, or train_iters x global_batch_size)."""
    o, t = cfg.optimizer, cfg.training
    constant = o.weight_decay_incr_style == "constant"
    return dict(
        start_wd=o.weight_decay if constant else o.start_weight_decay, end_wd=o.weight_decay if constant else o.end_weight_decay,
        wd_incr_steps=t.train_samples or t.train_iters * t.global_batch_size, wd_incr_style=o.weight_decay_incr_style,
    )  # fmt: skip


def megatron_scheduler(cfg: Config, groups: list[dict]):
    o = cfg.optimizer
    return optimizer_param_scheduler.OptimizerParamScheduler(
        types.SimpleNamespace(param_groups=groups), init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr,
        lr_decay_style=o.lr_decay_style, lr_wsd_decay_style=o.lr_wsd_decay_style, **megatron_lengths(cfg),
        **megatron_weight_decay(cfg),
    )  # fmt: skip


class _Decaying(torch.nn.Module):
    """A word embedding (decoupled_lr's group), a matrix (decays) and a bias (never decays)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word = torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4)


WD_SCHEDULES = {
    "constant": dict(weight_decay=0.05),
    "linear": dict(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1),
    "cosine": dict(weight_decay_incr_style="cosine", start_weight_decay=0.01, end_weight_decay=0.2),
}
RAMPUP = dict(global_batch_size=16, rampup_batch_size=[4, 4, 300], train_samples=900, train_iters=None)


@pytest.mark.parametrize("rampup", [False, True], ids=["iters", "rampup"])
@pytest.mark.parametrize("name", sorted(WD_SCHEDULES))
def test_weight_decay_follows_megatron_optimizer_param_scheduler(name, rampup):
    """Each group of build_optimizer (decaying, not decaying, decoupled_lr's) gets the weight
    decay Megatron's scheduler gives a group of its wd_mult, at every step: over and past the
    increment, after a resume from the state dicts (both rebuilt), and with the batch growing."""
    training = TrainingConfig(**RAMPUP) if rampup else TrainingConfig(global_batch_size=8, train_iters=120)
    cfg = Config(training=training, optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_samples=64, lr_decay_samples=800,
                                                              decoupled_lr=1e-3, **WD_SCHEDULES[name]))  # fmt: skip
    optimizer = build_optimizer(_Decaying().named_parameters(), cfg.optimizer)
    assert sorted(g[WD_MULT] for g in optimizer.param_groups) == [0.0, 1.0, 1.0]
    ours = LRSchedule(cfg)
    mirror = [{"wd_mult": g[WD_MULT]} for g in optimizer.param_groups]  # Megatron's groups carry their wd_mult
    theirs = megatron_scheduler(cfg, mirror)
    batches = BatchSizeSchedule(cfg.training).global_batch_size if rampup else lambda _: next(uneven)
    uneven = itertools.cycle((8, 8, 7, 16, 1, 8))
    seen = set()
    for step in range(160):
        if step == 80:  # resume: fresh schedules that load the saved ones
            ours, saved = LRSchedule(cfg), ours.state_dict()
            ours.load_state_dict(saved)
            resumed = megatron_scheduler(cfg, mirror)
            resumed.load_state_dict(theirs.state_dict())
            theirs = resumed
        ours.apply(optimizer)
        for group, megatron_group in zip(optimizer.param_groups, mirror):
            assert group["weight_decay"] == pytest.approx(megatron_group["weight_decay"], rel=1e-12, abs=0), (step, ours.num_samples)
        seen.add(round(ours.current_wd, 12))
        increment = batches(ours.num_samples)
        ours.step(increment)
        theirs.step(increment)
    assert ours.num_samples > ours.wd_incr_steps
    assert len(seen) == 1 if name == "constant" else len(seen) > 20


# -- batch-size ramp-up ------------------------------------------------------------------------

MCORE_0161 = Path(__file__).resolve().parents[1] / ".oracle" / "mcore-0.16.1"


def rampup_calculator() -> type:
    """megatron-core 0.16.1's RampupBatchsizeNumMicroBatchesCalculator: the venv's where it has
    it, else the module file of the copy in .oracle/mcore-0.16.1, loaded alone under its own name
    (it imports only the standard library, so none of 0.16.1 mixes with the venv's release)."""
    if hasattr(num_microbatches_calculator, "RampupBatchsizeNumMicroBatchesCalculator"):
        return num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator
    assert (MCORE_0161 / "megatron_core-0.16.1.dist-info").is_dir(), f"no megatron-core 0.16.1 in {MCORE_0161}: run `make setup`"
    spec = importlib.util.spec_from_file_location(
        "mcore_0161_num_microbatches_calculator", MCORE_0161 / "megatron" / "core" / "num_microbatches_calculator.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RampupBatchsizeNumMicroBatchesCalculator


@pytest.mark.parametrize(
    "rampup, gbs, micro, dp",
    [
        ([8, 8, 100], 96, 2, 2),  # 11 increments over 100 samples: the float division lands just short at the end
        ([4, 4, 1000], 64, 1, 4),
        ([16, 16, 5859375], 1536, 1, 16),  # GPT-3 175B (around each increment only)
    ],
)
def test_rampup_follows_megatron_num_microbatches_calculator(rampup, gbs, micro, dp):
    """The global batch and the micro-batches per rank at every consumed-sample count through
    the ramp and past it (for GPT-3, at and around each increment's boundary)."""
    cfg = Config(training=TrainingConfig(micro_batch_size=micro, global_batch_size=gbs, rampup_batch_size=rampup))
    ours = BatchSizeSchedule(cfg.training)
    start, increment, samples = rampup
    theirs = rampup_calculator()(
        global_batch_size=gbs, micro_batch_size=micro, data_parallel_size=dp, decrease_batch_size_if_needed=False,
        rank=0, start_global_batch_size=start, batch_size_increment=increment, ramup_samples=samples,
    )  # fmt: skip
    if samples <= 10_000:
        consumed = range(samples + 50)
    else:
        steps = (gbs - start) // increment
        edges = [round(k * samples / steps) for k in range(steps + 1)]
        consumed = sorted({max(0, e + d) for e in edges for d in range(-3, 4)})
    for c in consumed:
        theirs.update(c, consistency_check=True)
        batch = ours.global_batch_size(c)
        assert batch == theirs.get_current_global_batch_size(), c
        assert num_microbatches(cfg, dp, batch) == theirs.get(), c
    if samples <= 10_000:  # iterations as Megatron's loop takes them: each consumes its batch
        c = 0
        for i in range(samples // start + 5):
            assert ours.consumed_samples(i) == c, i
            theirs.update(c, consistency_check=True)
            c += theirs.get_current_global_batch_size()
