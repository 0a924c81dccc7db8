"""pretrain(): Megatron's flow, init -> model and optimizer -> data -> train -> final eval.

The trainer is one user of the library (dtgpt.api): it builds the model, the train state and the
data iterators with the same calls a hand-written loop makes, and each iteration is
dtgpt.step.train_step. What it adds is the run around them: checkpoints, metrics, evaluation,
exits on a signal or a budget, and the watchers of each iteration (dtgpt.faults).
Everything it needs is passed in: the config, a model provider and a datasets provider, the
way `pretrain_gpt.py` names its providers.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from dtgpt.api import (
    ModelProvider,
    build_data_iterators,
    build_model,
    build_train_state,
    evaluate,
    init_distributed,
    num_samples_needed,
    resumed_valid_samples,
    shutdown,
    train_step,
)
from dtgpt.config import Config, padded_vocabulary, to_toml
from dtgpt.config.batch_schedule import BatchSizeSchedule, train_iterations
from dtgpt.data import build_tokenizer
from dtgpt.data.batch import TokenOptions
from dtgpt.distributed import Runtime
from dtgpt.faults.injection import FaultHooks, build_faults
from dtgpt.faults.recovery import build_failure_watch, join, recover
from dtgpt.faults.signals import ExitConditions
from dtgpt.faults.watchdog import Watchdog
from dtgpt.metrics import MetricsLogger, memory_stats, peak_tflops, throughput_metrics
from dtgpt.model_size import flops_per_token
from dtgpt.parallel.replica_check import check_weight_hash
from dtgpt.profiling import build_profiler
from dtgpt.state import TrainState, set_rng_state
from dtgpt.step import StepResult
from dtgpt.summary import startup_summary

DatasetsProvider = Callable[[Config, object, tuple[int, int, int]], tuple]

TRAIN_ITERS_REACHED, SKIP_TRAIN = "train_iters reached", "eval.skip_train: no training"


class SkippedTooOftenError(RuntimeError):
    """training.exit_skipped_iters iterations in a row were skipped: the run is going nowhere."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss under nan_policy='stop')."""


def log0(runtime: Runtime, message: str) -> None:
    if runtime.is_main:
        print(message, flush=True)


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


class IterationGuard:
    """Everything that watches a training iteration from outside, composed once: the watchdog's
    phase (errors name the rank, phase and iteration), injected faults, and last words (the
    survivors' save when a peer dies). The step itself knows none of them."""

    def __init__(self, phase: Phase, faults: FaultHooks, last_words, state: TrainState):
        self.phase, self.faults, self.last_words, self.state = phase, faults, last_words, state

    @contextlib.contextmanager
    def __call__(self, iteration: int) -> Iterator[None]:
        parts, optimizers = self.state.model.parts, self.state.optimizer.optimizers
        with (
            self.phase("train-step", iteration, record=True),
            self.faults.iteration(iteration, parts, optimizers),
            self.last_words.iteration(),
        ):
            yield


def run_length(cfg: Config, iterations: int) -> str:
    """The key that sets the run's length, as the log names it."""
    t = cfg.training
    if t.train_samples is None:
        return f"training.train_iters={t.train_iters}"
    return f"training.train_samples={t.train_samples} ({iterations} iterations)"


@dataclass
class Builder:
    """What pretrain builds from the config on the current mesh: the train state, the datasets and
    iterators. An in-process recovery (dtgpt/faults/recovery.py) builds them again through this,
    so that survivors and the replacement issue the same collectives in the same order."""

    cfg: Config
    runtime: Runtime
    model_provider: ModelProvider
    datasets_provider: "DatasetsProvider"
    tokenizer: object

    def build_state(self) -> TrainState:
        return build_train_state(self.cfg, build_model(self.cfg, self.runtime, self.tokenizer.vocab_size, self.model_provider))

    def data(self, state: TrainState) -> tuple:
        """(datasets, train, validation, test iterators) from the state's consumed sample counts."""
        cfg, progress = self.cfg, state.progress
        datasets = self.datasets_provider(cfg, self.tokenizer, num_samples_needed(cfg))
        options = TokenOptions.from_config(cfg.data, self.tokenizer.eod)
        iterators = build_data_iterators(
            cfg, state.model, datasets, options, progress.consumed_samples, progress.consumed_valid_samples
        )
        return (datasets, *iterators)


def check_nan(runtime: Runtime, cfg: Config, result: StepResult, iteration: int) -> None:
    """training.nan_policy on a non-finite loss or gradient norm: stop, or say it was skipped."""
    if not result.nan:
        return
    if cfg.training.nan_policy == "stop":
        raise TrainingError(
            f"non-finite loss {result.loss} or grad norm {result.grad_norm} at iteration {iteration} "
            "(training.nan_policy='stop')"
        )
    log0(runtime, f"iteration {iteration}: non-finite loss or grad norm, skipped")


def check_skipped(in_a_row: int, limit: int, iteration: int) -> None:
    """Megatron-style: stop (without saving) once `limit` iterations in a row were skipped."""
    if limit and in_a_row >= limit:
        raise SkippedTooOftenError(
            f"the last {in_a_row} iterations (up to {iteration}) were all skipped for a non-finite loss, grad norm "
            f"or loss-scale overflow (training.exit_skipped_iters={limit}): stopping without saving; check "
            "optimizer.lr, the data and the loss scale, then resume from the last checkpoint"
        )


def iteration_record(
    cfg: Config, runtime: Runtime, state: TrainState, result: StepResult, elapsed: float, flops: float, peak
) -> dict:
    """The metrics record of the iteration just taken (dtgpt.metrics.METRICS_KEYS)."""
    progress = state.progress
    rates = throughput_metrics(
        tokens=result.global_batch_size * cfg.model.seq_length, flops_per_token=flops,
        elapsed_s=elapsed, world_size=runtime.world_size, peak=peak,
    )  # fmt: skip
    return {
        "iteration": progress.iteration, "consumed_samples": progress.consumed_samples, "loss": result.loss,
        "lr": result.lr, "grad_norm": result.grad_norm, "loss_scale": state.scaler.scale,
        "global_batch_size": result.global_batch_size, "skipped": progress.skipped_iters, "nan": progress.nan_iters,
        "elapsed_ms": 1000 * elapsed, **rates, **memory_stats(runtime.device), **(result.moe or {}),
        **(result.mtp or {}),
    }  # fmt: skip


def train(
    cfg: Config, runtime: Runtime, state: TrainState, train_iter: Iterator, valid_iter: Iterator | None,
    metrics: MetricsLogger, checkpointer, exits: ExitConditions, faults: FaultHooks, builder: Builder | None = None,
    test_iter: Iterator | None = None,
) -> str:
    """The loop, then the final save and the final evaluation (under the same watch: a dead peer
    there is said in one line, with last words); returns why it stopped."""
    progress, timers = state.progress, state.timers
    profiler = build_profiler(cfg, runtime.rank, runtime.device)
    watchdog = Watchdog(runtime.rank, cfg.distributed.heartbeat_factor, cfg.distributed.heartbeat_min_seconds)
    phase = Phase(watchdog, runtime.rank)
    last_words = build_failure_watch(cfg, runtime, state, checkpointer)
    guard = IterationGuard(phase, faults, last_words, state)
    peak = peak_tflops(runtime.device, cfg.logging.peak_tflops)
    flops = flops_per_token(cfg.model, state.model.parts[0].vocab_size)
    reason, skipped_in_a_row = TRAIN_ITERS_REACHED, 0
    left_out = set(cfg.training.iterations_to_skip)
    end = train_iterations(cfg.training, cfg.model.seq_length)
    if progress.iteration >= end:
        log0(runtime, f"> nothing to train: the run is at iteration {progress.iteration} and {run_length(cfg, end)}; "
                      "raise that key to train on (with optimizer.override_opt_param_scheduler=true where the LR "
                      "schedule follows it)")  # fmt: skip
    state.model.train(True)
    try:
        while progress.iteration < end:
            if progress.iteration + 1 in left_out:  # Megatron's --iterations-to-skip
                leave_out(cfg, runtime, state, train_iter)
                continue
            profiler.step(progress.iteration + 1)
            start = time.perf_counter()
            with guard(progress.iteration + 1):
                with timers("batch-generator"):
                    batch = next(train_iter)
                result = train_step(cfg, state, batch)
            if getattr(last_words, "pending", None) is not None:  # recovered in-process: redo the iteration
                train_iter, valid_iter, last_words = _recovered(last_words, state, builder, checkpointer, metrics)
                guard = IterationGuard(phase, faults, last_words, state)
                continue
            elapsed = time.perf_counter() - start
            check_nan(runtime, cfg, result, progress.iteration)
            with last_words.guard("timers' reduction"):  # a collective at each log interval
                metrics.log(iteration_record(cfg, runtime, state, result, elapsed, flops, peak), timers)
            skipped_in_a_row = skipped_in_a_row + 1 if result.skipped else 0
            check_skipped(skipped_in_a_row, cfg.training.exit_skipped_iters, progress.iteration)
            if valid_iter is not None and cfg.eval.eval_iters and progress.iteration % cfg.eval.eval_interval == 0:
                with phase("evaluate", progress.iteration), timers("evaluate"), last_words.guard("evaluation"):
                    loss = run_validation(cfg, state, valid_iter)
                metrics.log_eval(progress.iteration, "validation", loss)
            with last_words.guard():  # collectives between iterations: a dead peer is recovered from here too
                if progress.iteration % cfg.logging.log_interval == 0:
                    state.model.check_tied_copies(progress.iteration)
                check_weight_hash(state.model, cfg.training.check_weight_hash_across_dp_replicas_interval, progress.iteration)
                stop = exits.reason(progress.iteration)
            if getattr(last_words, "pending", None) is not None:  # the next iteration starts afresh
                train_iter, valid_iter, last_words = _recovered(last_words, state, builder, checkpointer, metrics)
                guard = IterationGuard(phase, faults, last_words, state)
                continue
            if checkpointer is not None and (stop or checkpointer.due(progress.iteration)):
                with phase("save-checkpoint", progress.iteration), timers("save-checkpoint"), last_words.guard("checkpoint save"):
                    checkpointer.save(progress.iteration)
            if stop:
                reason = stop
                break
        if checkpointer is not None:
            with phase("save-checkpoint", progress.iteration), timers("save-checkpoint"), last_words.guard("final checkpoint save"):
                checkpointer.save_final(progress.iteration)
        log0(runtime, f"> training stopped: {reason}")
        with phase("evaluate", progress.iteration), last_words.guard("final evaluation"):
            final_evaluation(cfg, state, metrics, valid_iter, test_iter, reason)
    finally:
        profiler.close()
        watchdog.close()
        last_words.close()
    return reason


def leave_out(cfg: Config, runtime: Runtime, state: TrainState, train_iter: Iterator) -> None:
    """Read the next iteration's batch and count its samples as consumed, with no forward,
    backward or update: Megatron's --iterations-to-skip (a batch known to break the run)."""
    size = BatchSizeSchedule(cfg.training, cfg.model.seq_length).global_batch_size(state.progress.consumed_samples)
    with state.timers("batch-generator"):
        next(train_iter)
    state.pass_over(size)
    log0(runtime, f"iteration {state.progress.iteration}: left out (training.iterations_to_skip), its {size} samples consumed")


def _recovered(watch, state: TrainState, builder: Builder, checkpointer, metrics: MetricsLogger) -> tuple:
    """Carry out the in-process recovery `watch` decided; (train iterator, validation iterator, new watch)."""
    pending, watch.pending = watch.pending, None
    watch.close()
    train_iter, valid_iter = recover(pending, state, builder, checkpointer, metrics.kept)
    return train_iter, valid_iter, build_failure_watch(builder.cfg, builder.runtime, state, checkpointer, after=watch)


def build_checkpointer(cfg: Config, runtime: Runtime, state: TrainState, faults: FaultHooks, joining: bool = False):
    """The checkpoint manager when saving or loading is configured (it loads on construction, from
    checkpoint.pretrained_checkpoint while the load directory holds none; not when `joining`: a
    replacement's state came from its replica twin)."""
    c = cfg.checkpoint
    if not (c.save or c.load or c.pretrained_checkpoint):
        return None
    from dtgpt.checkpoint import Checkpointer
    from dtgpt.checkpoint.resume_controls import pretrained_start

    return Checkpointer(state, pretrained_start(cfg), runtime, faults, joining=joining)


def pretrain(cfg: Config, model_provider: ModelProvider, datasets_provider: DatasetsProvider) -> TrainState:
    """Train per `cfg`; returns the final TrainState. Always shuts the process group down."""
    runtime = init_distributed(cfg)
    clean, checkpointer = False, None
    try:
        tokenizer = build_tokenizer(cfg.data)
        builder = Builder(cfg, runtime, model_provider, datasets_provider, tokenizer)
        state = builder.build_state()
        # A replacement's state comes from its replica twin, in the survivors' order of collectives.
        joined = join(state, runtime) if runtime.replacement else None
        faults = build_faults(cfg.faults, runtime.rank, runtime.restart_count + runtime.replacement, runtime.store)
        checkpointer = build_checkpointer(cfg, runtime, state, faults, joining=joined is not None)
        progress = state.progress  # a resumed run starts from the checkpoint's counts
        progress.consumed_valid_samples = resumed_valid_samples(cfg, progress)
        datasets, train_iter, valid_iter, test_iter = builder.data(state)
        n_params = sum(p.numel() for p in state.model.parameters())
        vocab_size = padded_vocabulary(cfg, tokenizer.vocab_size)
        log0(runtime, startup_summary(cfg, runtime.dims, n_params, vocab_size, tokenizer, datasets))
        # Only now: creating the loaders' iterators draws from the RNG.
        if joined is not None:
            set_rng_state(joined["rng"], state.model)
        elif checkpointer is not None:
            checkpointer.restore_rng()
        metrics = MetricsLogger(
            cfg.logging, train_iterations(cfg.training, cfg.model.seq_length), runtime.is_logging_rank, to_toml(cfg),
            skipped_before=progress.skipped_iters, nan_before=progress.nan_iters,
            # a restarted attempt or a replacement continues the file
            resumed=progress.iteration > 0 or runtime.restart_count > 0 or runtime.replacement > 0,
        )  # fmt: skip
        if joined is not None:  # its twin's last record: written here if the logging rank died before it was
            metrics.take_over(joined["metrics"])
        # SIGTERM/SIGINT are caught from here until the last save has completed (finalize()).
        exits = ExitConditions(cfg.checkpoint, runtime.device, announce=runtime.is_main)
        try:
            if cfg.eval.skip_train:  # Megatron's --skip-train: evaluate the loaded model, save nothing
                log0(runtime, f"> skipping training (eval.skip_train): evaluating iteration {progress.iteration}")
                final_evaluation(cfg, state, metrics, valid_iter, test_iter, SKIP_TRAIN)
            else:
                train(cfg, runtime, state, train_iter, valid_iter, metrics, checkpointer, exits, faults, builder, test_iter)
        finally:
            metrics.close()
            try:
                if checkpointer is not None:
                    checkpointer.finalize()
            finally:
                exits.close()
        clean = True
        return state
    finally:
        if checkpointer is not None:
            checkpointer.release()  # after a failed start too: no lock left in the save directory
        shutdown(clean, runtime.dims)


def run_validation(cfg: Config, state: TrainState, valid_iter: Iterator) -> float:
    """Evaluate on the next eval_iters validation batches and count them as consumed (saved with
    the checkpoint, so a resumed run reads the batches an uninterrupted one would)."""
    loss = evaluate(cfg, state.model, valid_iter, cfg.eval.eval_iters)
    state.progress.consumed_valid_samples += cfg.eval.eval_iters * cfg.training.global_batch_size
    return loss


def final_evaluation(cfg: Config, state: TrainState, metrics: MetricsLogger, valid_iter, test_iter, reason: str) -> None:
    """After the last iteration (or instead of training, under eval.skip_train): validation (unless
    just done) and test, as Megatron ends a run."""
    iteration = state.progress.iteration
    if reason not in (TRAIN_ITERS_REACHED, SKIP_TRAIN) or not cfg.eval.eval_iters:
        return
    just_evaluated = reason == TRAIN_ITERS_REACHED and iteration % cfg.eval.eval_interval == 0
    if valid_iter is not None and not just_evaluated:
        metrics.log_eval(iteration, "validation", run_validation(cfg, state, valid_iter))
    if test_iter is not None:
        metrics.log_eval(iteration, "test", evaluate(cfg, state.model, test_iter, cfg.eval.eval_iters))
