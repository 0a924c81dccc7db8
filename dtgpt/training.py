"""pretrain(): Megatron's flow, initialize -> model and optimizer -> data -> train -> final eval.

Everything it needs is passed in: the config, a model provider and a datasets provider, the
way `pretrain_gpt.py` names its providers.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from dtgpt.config import Config, num_microbatches, padded_vocabulary, to_toml
from dtgpt.data import build_data_loader, build_tokenizer
from dtgpt.data.batch import TokenOptions
from dtgpt.distributed import Runtime, initialize, shutdown
from dtgpt.faults.injection import FaultHooks, build_faults
from dtgpt.faults.last_words import build_last_words
from dtgpt.faults.signals import ExitConditions
from dtgpt.metrics import MetricsLogger, memory_stats, peak_tflops, throughput_metrics
from dtgpt.model import GPT, flops_per_token
from dtgpt.optim import BatchSizeSchedule, total_train_samples
from dtgpt.parallel import build_model
from dtgpt.profiling import Profiler
from dtgpt.state import TrainState, build_train_state
from dtgpt.summary import startup_summary
from dtgpt.step import StepResult, forward_backward, reduce_loss, train_step
from dtgpt.timers import Timers
from dtgpt.faults.watchdog import Watchdog

ModelProvider = Callable[[Config, int], GPT]
DatasetsProvider = Callable[[Config, object, tuple[int, int, int]], tuple]


class SkippedTooOftenError(RuntimeError):
    """training.exit_skipped_iters iterations in a row were skipped: the run is going nowhere."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss under nan_policy='stop')."""


@dataclass
class Trainer:
    """What a training run threads through its loop: the config, the runtime and the train state
    (everything a checkpoint restores, dtgpt.state), plus what is derived from the config."""

    cfg: Config
    runtime: Runtime
    state: TrainState
    batch_sizes: BatchSizeSchedule
    flops_per_token: float
    faults: FaultHooks

    def num_microbatches(self, global_batch_size: int) -> int:
        return num_microbatches(self.cfg, self.state.model.dims.dp, global_batch_size)


def log0(runtime: Runtime, message: str) -> None:
    if runtime.is_main:
        print(message, flush=True)


def build_model_and_state(cfg: Config, runtime: Runtime, model_provider: ModelProvider, vocab_size: int) -> TrainState:
    """Model on meta -> parallelised parts on the device -> the train state (AdamW, LR schedule,
    loss scaler) around them. The padded vocabulary was checked against tp by the caller."""
    with torch.device("meta"):
        whole = model_provider(cfg, vocab_size)
    return build_train_state(cfg, build_model(cfg, runtime.dims, whole, runtime.device))


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


def build_data_iterators(
    cfg: Config, runtime: Runtime, datasets: tuple, consumed: int, batch_sizes: BatchSizeSchedule, reads_batches: bool,
    options: TokenOptions | None = None,
):
    """Train, validation and test iterators of this rank's batches (Batches under `options`). A
    middle pipeline stage that needs no per-token inputs reads none (it gets None per batch) and
    starts no loader workers; it still builds the datasets, whose index caches are built collectively."""
    train_ds, valid_ds, test_ds = datasets
    if not reads_batches:
        nothing = itertools.repeat(None)
        return nothing, nothing if valid_ds is not None else None, nothing if test_ds is not None else None
    dims, workers = runtime.dims, cfg.data.num_workers

    def loader(dataset, start, size_at):
        return build_data_loader(dataset, start, size_at, dims.dp_rank, dims.dp, workers, options)

    train_iter = iter(loader(train_ds, consumed, batch_sizes.global_batch_size))
    eval_size = lambda _consumed: cfg.training.global_batch_size  # noqa: E731
    valid_iter = cycle(lambda: loader(valid_ds, 0, eval_size)) if valid_ds is not None else None
    test_iter = cycle(lambda: loader(test_ds, 0, eval_size)) if test_ds is not None else None
    return train_iter, valid_iter, test_iter


@torch.no_grad()
def evaluate(trainer: Trainer, data_iter: Iterator, num_batches: int) -> float:
    """Mean loss over `num_batches` global batches, forward only (through the pipeline if any)."""
    model = trainer.state.model
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
    start = time.perf_counter()
    with timers("batch-generator"):
        batch = next(train_iter)
    result, gbs, lr = step_state(trainer, batch, timers)
    elapsed = time.perf_counter() - start
    if result.nan:
        iteration = state.progress.iteration
        if cfg.training.nan_policy == "stop":
            raise TrainingError(
                f"non-finite loss {result.loss} or grad norm {result.grad_norm} at iteration {iteration} "
                "(training.nan_policy='stop')"
            )
        log0(trainer.runtime, f"iteration {iteration}: non-finite loss or grad norm, skipped")
    return result, gbs, lr, elapsed


def step_state(trainer: Trainer, batch: torch.Tensor | None, timers: Timers | None = None) -> tuple[StepResult, int, float]:
    """Set the LR, take one training step on global batch k, advance the state; (result, gbs, lr).
    The library's dtgpt.train_step is this function."""
    state = trainer.state
    gbs = trainer.batch_sizes.global_batch_size(state.progress.consumed_samples)
    lr = state.lr_schedule.apply(state.optimizer)
    result = train_step(
        state.model, state.optimizer, state.scaler, batch, trainer.num_microbatches(gbs),
        trainer.cfg.optimizer.clip_grad, timers=timers,
    )  # fmt: skip
    state.record(skipped=result.skipped, nan=result.nan, global_batch_size=gbs)
    return result, gbs, lr


def log_iteration(
    trainer: Trainer, metrics: MetricsLogger, result: StepResult, gbs: int, lr: float, elapsed: float, peak, timers: Timers,
) -> None:
    state, runtime = trainer.state.progress, trainer.runtime
    rates = throughput_metrics(
        tokens=gbs * trainer.cfg.model.seq_length, flops_per_token=trainer.flops_per_token,
        elapsed_s=elapsed, world_size=runtime.world_size, peak=peak,
    )  # fmt: skip
    metrics.log(
        {
            "iteration": state.iteration, "consumed_samples": state.consumed_samples, "loss": result.loss,
            "lr": lr, "grad_norm": result.grad_norm, "loss_scale": trainer.state.scaler.scale,
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


def check_skipped(in_a_row: int, limit: int, iteration: int) -> None:
    """Megatron-style: stop (without saving) once `limit` iterations in a row were skipped."""
    if limit and in_a_row >= limit:
        raise SkippedTooOftenError(
            f"the last {in_a_row} iterations (up to {iteration}) were all skipped for a non-finite loss, grad norm "
            f"or loss-scale overflow (training.exit_skipped_iters={limit}): stopping without saving; check "
            "optimizer.lr, the data and the loss scale, then resume from the last checkpoint"
        )


def train(
    trainer: Trainer, train_iter: Iterator, valid_iter: Iterator | None, metrics: MetricsLogger, checkpointer,
    exits: ExitConditions,
) -> str:
    """The loop, then the final save; returns why it stopped."""
    cfg, runtime, progress = trainer.cfg, trainer.runtime, trainer.state.progress
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
    skipped_in_a_row = 0
    last_words = build_last_words(cfg, runtime, trainer.state, checkpointer)
    trainer.state.model.train(True)
    try:
        while progress.iteration < cfg.training.train_iters:
            upcoming = progress.iteration + 1
            profiler.step(upcoming)
            with (
                phase("train-step", upcoming, record=True),
                trainer.faults.iteration(upcoming, trainer.state.model.parts, trainer.state.optimizer.optimizers),
                last_words.iteration(),
            ):
                result, gbs, lr, elapsed = run_iteration(trainer, train_iter, timers)
            log_iteration(trainer, metrics, result, gbs, lr, elapsed, peak, timers)
            if progress.iteration % cfg.logging.log_interval == 0:
                trainer.state.model.check_tied_copies(progress.iteration)
            skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
            check_skipped(skipped_in_a_row, cfg.training.exit_skipped_iters, progress.iteration)
            if valid_iter is not None and cfg.eval.eval_iters and progress.iteration % cfg.eval.eval_interval == 0:
                with phase("evaluate", progress.iteration), timers("evaluate"):
                    metrics.log_eval(progress.iteration, "validation", evaluate(trainer, valid_iter, cfg.eval.eval_iters))
            with last_words.guard():
                stop = exits.reason(progress.iteration)
            if checkpointer is not None and (stop or checkpointer.due(progress.iteration)):
                with phase("save-checkpoint", progress.iteration), timers("save-checkpoint"):
                    checkpointer.save(progress.iteration)
            if stop:
                reason = stop
                break
        if checkpointer is not None:
            with phase("save-checkpoint", progress.iteration), timers("save-checkpoint"):
                checkpointer.save_final(progress.iteration)
    finally:
        profiler.close()
        watchdog.close()
    return reason


def build_trainer(cfg: Config, runtime: Runtime, state: TrainState) -> Trainer:
    vocab_size = state.model.parts[0].vocab_size
    faults = build_faults(cfg.faults, runtime.rank, runtime.restart_count)
    return Trainer(cfg, runtime, state, BatchSizeSchedule(cfg.training), flops_per_token(cfg.model, vocab_size), faults)


def pretrain(cfg: Config, model_provider: ModelProvider, datasets_provider: DatasetsProvider) -> TrainState:
    """Train per `cfg`; returns the final TrainState. Always shuts the process group down."""
    runtime = initialize(cfg)
    clean = False
    try:
        tokenizer = build_tokenizer(cfg.data)
        vocab_size = padded_vocabulary(cfg, tokenizer.vocab_size)
        trainer = build_trainer(cfg, runtime, build_model_and_state(cfg, runtime, model_provider, vocab_size))
        checkpointer = build_checkpointer(trainer)
        datasets = datasets_provider(cfg, tokenizer, num_samples_needed(cfg))
        n_params = sum(p.numel() for p in trainer.state.model.parameters())
        log0(runtime, startup_summary(cfg, runtime.dims, n_params, vocab_size, tokenizer, datasets))
        train_iter, valid_iter, test_iter = build_data_iterators(
            cfg, runtime, datasets, trainer.state.progress.consumed_samples, trainer.batch_sizes,
            trainer.state.model.reads_batches, TokenOptions.from_config(cfg.data, tokenizer.eod),
        )
        if checkpointer is not None:
            checkpointer.restore_rng()  # only now: creating the loaders' iterators draws from the RNG
        progress = trainer.state.progress  # a resumed run starts from the checkpoint's counts
        metrics = MetricsLogger(
            cfg.logging, cfg.training.train_iters, runtime.is_logging_rank, to_toml(cfg),
            skipped_before=progress.skipped_iters, nan_before=progress.nan_iters,
        )  # fmt: skip
        # SIGTERM/SIGINT are caught from here until the last save has completed (finalize()).
        exits = ExitConditions(cfg.checkpoint, runtime.device)
        try:
            reason = train(trainer, train_iter, valid_iter, metrics, checkpointer, exits)
            log0(runtime, f"> training stopped: {reason}")
            iteration = trainer.state.progress.iteration
            if reason == "train_iters reached" and cfg.eval.eval_iters:
                if valid_iter is not None and iteration % cfg.eval.eval_interval:  # not just evaluated
                    metrics.log_eval(iteration, "validation", evaluate(trainer, valid_iter, cfg.eval.eval_iters))
                if test_iter is not None:
                    metrics.log_eval(iteration, "test", evaluate(trainer, test_iter, cfg.eval.eval_iters))
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

    return Checkpointer(trainer.state, trainer.cfg, trainer.runtime, trainer.faults)
