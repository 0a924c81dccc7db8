"""pretrain(): Megatron's flow, initialize -> model and optimizer -> data -> train -> final eval.

Everything it needs is passed in: the config, a model provider and a datasets provider, the
way `pretrain_gpt.py` names its providers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful

from dtgpt.config import Config, num_microbatches, padded_vocabulary, to_toml
from dtgpt.data import build_data_loader, build_tokenizer
from dtgpt.distributed import Runtime, initialize, shutdown
from dtgpt.exits import ExitConditions
from dtgpt.faults import Faults
from dtgpt.loss_scaler import build_loss_scaler
from dtgpt.metrics import MetricsLogger, memory_stats, peak_tflops, throughput_metrics
from dtgpt.model import GPT, flops_per_token
from dtgpt.optim import BatchSizeSchedule, LRSchedule, PartOptimizers, total_train_samples
from dtgpt.parallel import ModelParts, build_model
from dtgpt.profiling import Profiler
from dtgpt.step import StepResult, forward_backward, reduce_loss, train_step
from dtgpt.timers import Timers
from dtgpt.watchdog import Watchdog

ModelProvider = Callable[[Config, int], GPT]
DatasetsProvider = Callable[[Config, object, tuple[int, int, int]], tuple]


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss under nan_policy='stop')."""


@dataclass
class TrainState(Stateful):
    """Progress that a checkpoint must carry, saved through DCP by name."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, int(state[f.name]))


@dataclass
class Trainer:
    """The objects a training run threads through its loop."""

    cfg: Config
    runtime: Runtime
    model: ModelParts
    optimizer: PartOptimizers
    lr_schedule: LRSchedule
    scaler: object
    batch_sizes: BatchSizeSchedule
    state: TrainState
    flops_per_token: float

    def num_microbatches(self, global_batch_size: int) -> int:
        return num_microbatches(self.cfg, self.runtime.dims.dp, global_batch_size)


def log0(runtime: Runtime, message: str) -> None:
    if runtime.is_main:
        print(message, flush=True)


def setup_model_and_optimizer(cfg: Config, runtime: Runtime, model_provider: ModelProvider, vocab_size: int):
    """Model on meta -> parallelised parts on the device -> AdamW, LR schedule, loss scaler."""
    with torch.device("meta"):
        whole = model_provider(cfg, vocab_size)
    model = build_model(cfg, runtime.dims, whole, runtime.device)
    implementation = "fused" if runtime.device.type == "cuda" else "foreach"
    optimizer = PartOptimizers(model.parts, cfg.optimizer, implementation=implementation)
    return model, optimizer, LRSchedule(cfg), build_loss_scaler(cfg)


def num_samples_needed(cfg: Config) -> tuple[int, int, int]:
    """Samples of train, valid and test that the run will read (Megatron's accounting)."""
    t, e = cfg.training, cfg.eval
    evals = t.train_iters // e.eval_interval + 1
    return total_train_samples(t), evals * e.eval_iters * t.global_batch_size, e.eval_iters * t.global_batch_size


def cycle(make: Callable[[], Iterator]) -> Iterator:
    """Loop over a finite loader forever (evaluation reads a fixed number of batches each time)."""
    while True:
        empty = True
        for item in make():
            empty = False
            yield item
        if empty:
            return


def build_data_iterators(cfg: Config, runtime: Runtime, datasets_provider: DatasetsProvider, tokenizer, consumed: int, batch_sizes: BatchSizeSchedule):
    train_ds, valid_ds, test_ds = datasets_provider(cfg, tokenizer, num_samples_needed(cfg))
    dims, workers = runtime.dims, cfg.data.num_workers

    def loader(dataset, start, size_at):
        return build_data_loader(dataset, start, size_at, dims.dp_rank, dims.dp, workers)

    train_iter = iter(loader(train_ds, consumed, batch_sizes.global_batch_size))
    eval_size = lambda _consumed: cfg.training.global_batch_size  # noqa: E731
    valid_iter = cycle(lambda: loader(valid_ds, 0, eval_size)) if valid_ds is not None else None
    test_iter = cycle(lambda: loader(test_ds, 0, eval_size)) if test_ds is not None else None
    return train_iter, valid_iter, test_iter


@torch.no_grad()
def evaluate(trainer: Trainer, data_iter: Iterator, num_batches: int) -> float:
    """Mean loss over `num_batches` global batches, forward only (through the pipeline if any)."""
    model = trainer.model
    model.train(False)
    n_micro = trainer.num_microbatches(trainer.cfg.training.global_batch_size)
    total = torch.zeros((), device=model.device)
    for _ in range(num_batches):
        total += reduce_loss(model, forward_backward(model, next(data_iter), n_micro, forward_only=True))
    model.train(True)
    return total.item() / max(num_batches, 1)


def run_iteration(trainer: Trainer, train_iter: Iterator, timers: Timers) -> tuple[StepResult, int, float, float]:
    """Fetch global batch k, take one training step, advance the state; (result, gbs, lr, seconds)."""
    cfg, state = trainer.cfg, trainer.state
    gbs = trainer.batch_sizes.global_batch_size(state.consumed_samples)
    start = time.perf_counter()
    with timers("batch-generator"):
        batch = next(train_iter)
    lr = trainer.lr_schedule.apply(trainer.optimizer)
    result = train_step(
        trainer.model, trainer.optimizer, trainer.scaler, batch, trainer.num_microbatches(gbs),
        cfg.optimizer.clip_grad, inject_nan=state.iteration + 1 in cfg.faults.nan_at_iterations, timers=timers,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    state.iteration += 1
    state.consumed_samples += gbs  # consumed even when skipped, as in Megatron
    if result.skipped:
        state.skipped_iters += 1
    else:
        trainer.lr_schedule.step(gbs)
    if result.nan:
        state.nan_iters += 1
        if cfg.training.nan_policy == "stop":
            raise TrainingError(
                f"non-finite loss {result.loss} or grad norm {result.grad_norm} at iteration {state.iteration} "
                "(training.nan_policy='stop')"
            )
        log0(trainer.runtime, f"iteration {state.iteration}: non-finite loss or grad norm, skipped")
    return result, gbs, lr, elapsed


def log_iteration(
    trainer: Trainer, metrics: MetricsLogger, result: StepResult, gbs: int, lr: float, elapsed: float, peak, timers: Timers,
) -> None:
    state, runtime = trainer.state, trainer.runtime
    rates = throughput_metrics(
        tokens=gbs * trainer.cfg.model.seq_length, flops_per_token=trainer.flops_per_token,
        elapsed_s=elapsed, world_size=runtime.world_size, peak=peak,
    )  # fmt: skip
    metrics.log(
        {
            "iteration": state.iteration, "consumed_samples": state.consumed_samples, "loss": result.loss,
            "lr": lr, "grad_norm": result.grad_norm, "loss_scale": trainer.scaler.scale,
            "global_batch_size": gbs, "skipped": state.skipped_iters, "nan": state.nan_iters,
            "elapsed_ms": 1000 * elapsed, **rates, **memory_stats(runtime.device),
        },
        timers,
    )  # fmt: skip


class Phase:
    """Name what the rank is doing, for the watchdog's heartbeat and for errors.

    An exception inside (a collective timing out on a dead peer, say) is re-raised naming the
    rank, the phase and the iteration, instead of a bare backend message.
    """

    def __init__(self, watchdog: Watchdog, rank: int):
        self.watchdog, self.rank = watchdog, rank

    @contextlib.contextmanager
    def __call__(self, name: str, iteration: int, record: bool = False):
        self.watchdog.enter(name, iteration)
        try:
            yield
        except (RuntimeError, OSError) as e:
            if isinstance(e, TrainingError):
                raise
            raise TrainingError(f"rank {self.rank}: {name} of iteration {iteration} failed: {e}") from e
        finally:
            self.watchdog.leave(record=record)


def train(
    trainer: Trainer, train_iter: Iterator, valid_iter: Iterator | None, metrics: MetricsLogger, checkpointer,
    exits: ExitConditions,
) -> str:
    """The loop, then the final save; returns why it stopped."""
    cfg, runtime, state = trainer.cfg, trainer.runtime, trainer.state
    faults = Faults(cfg.faults, runtime.rank, runtime.restart_count)
    timers = Timers(cfg.logging.timers_log_level, runtime.device)
    prof = cfg.profiling
    profiler = Profiler(
        prof.profile_step_start, prof.profile_step_end, prof.trace_dir, prof.memory_snapshot_path,
        rank=runtime.rank, device=runtime.device,
    )  # fmt: skip
    watchdog = Watchdog(runtime.rank, cfg.distributed.heartbeat_factor, cfg.distributed.heartbeat_min_seconds)
    phase = Phase(watchdog, runtime.rank)
    peak = peak_tflops(runtime.device, cfg.logging.peak_tflops)
    reason = "train_iters reached"
    trainer.model.train(True)
    try:
        while state.iteration < cfg.training.train_iters:
            profiler.step(state.iteration + 1)
            with phase("train-step", state.iteration + 1, record=True):
                faults.in_iteration(state.iteration + 1)
                result, gbs, lr, elapsed = run_iteration(trainer, train_iter, timers)
            log_iteration(trainer, metrics, result, gbs, lr, elapsed, peak, timers)
            if valid_iter is not None and cfg.eval.eval_iters and state.iteration % cfg.eval.eval_interval == 0:
                with phase("evaluate", state.iteration), timers("evaluate"):
                    metrics.log_eval(state.iteration, "validation", evaluate(trainer, valid_iter, cfg.eval.eval_iters))
            stop = exits.reason(state.iteration)
            if checkpointer is not None and (stop or checkpointer.due(state.iteration)):
                with phase("save-checkpoint", state.iteration), timers("save-checkpoint"):
                    checkpointer.save(state.iteration)
            if stop:
                reason = stop
                break
        if checkpointer is not None and state.iteration and not checkpointer.saved(state.iteration):
            with phase("save-checkpoint", state.iteration), timers("save-checkpoint"):
                checkpointer.save(state.iteration)
    finally:
        profiler.close()
        watchdog.close()
    return reason


def pretrain(cfg: Config, model_provider: ModelProvider, datasets_provider: DatasetsProvider) -> TrainState:
    """Train per `cfg`; returns the final TrainState. Always shuts the process group down."""
    runtime = initialize(cfg)
    clean = False
    try:
        tokenizer = build_tokenizer(cfg.data)
        vocab_size = padded_vocabulary(cfg, tokenizer.vocab_size)
        model, optimizer, lr_schedule, scaler = setup_model_and_optimizer(cfg, runtime, model_provider, vocab_size)
        trainer = Trainer(
            cfg, runtime, model, optimizer, lr_schedule, scaler, BatchSizeSchedule(cfg.training), TrainState(),
            flops_per_token(cfg.model, vocab_size),
        )  # fmt: skip
        n_params = sum(p.numel() for p in model.parameters())
        log0(runtime, f"> model: {n_params:,} parameters on rank 0 (padded vocabulary {vocab_size}), mesh {runtime.dims}")
        checkpointer = build_checkpointer(trainer)
        train_iter, valid_iter, test_iter = build_data_iterators(
            cfg, runtime, datasets_provider, tokenizer, trainer.state.consumed_samples, trainer.batch_sizes
        )
        if checkpointer is not None:
            checkpointer.restore_rng()  # only now: creating the loaders' iterators draws from the RNG
        metrics = MetricsLogger(cfg.logging, cfg.training.train_iters, runtime.is_logging_rank, to_toml(cfg))
        # SIGTERM/SIGINT are caught from here until the last save has completed (finalize()).
        exits = ExitConditions(cfg.checkpoint, runtime.device)
        try:
            reason = train(trainer, train_iter, valid_iter, metrics, checkpointer, exits)
            log0(runtime, f"> training stopped: {reason}")
            if reason == "train_iters reached" and cfg.eval.eval_iters:
                if valid_iter is not None and trainer.state.iteration % cfg.eval.eval_interval:  # not just evaluated
                    metrics.log_eval(trainer.state.iteration, "validation", evaluate(trainer, valid_iter, cfg.eval.eval_iters))
                if test_iter is not None:
                    metrics.log_eval(trainer.state.iteration, "test", evaluate(trainer, test_iter, cfg.eval.eval_iters))
        finally:
            metrics.close()
            try:
                if checkpointer is not None:
                    checkpointer.finalize()
            finally:
                exits.close()
        clean = True
        return trainer.state
    finally:
        shutdown(clean)


def build_checkpointer(trainer: Trainer):
    """The checkpoint manager when saving or loading is configured (it loads on construction)."""
    c = trainer.cfg.checkpoint
    if not (c.save or c.load):
        return None
    from dtgpt.checkpoint import Checkpointer

    return Checkpointer(trainer)
