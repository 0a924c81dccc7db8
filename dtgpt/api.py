"""dtgpt as a library: the calls that train.py's pretrain() is made of, for a loop of your own.

    cfg = make_config(model={...}, parallel={"tensor_model_parallel_size": 2}, ...)
    runtime = init_distributed(cfg)                  # process group, mesh, device, seeds
    model = build_model(cfg, runtime, vocab_size)    # this rank's parallelised model parts
    batches = build_train_iterator(cfg, runtime)     # this rank's share of each global batch
    loss = forward_backward(model, next(batches), num_microbatches(cfg, runtime))

    state = build_train_state(cfg, model)            # AdamW, LR schedule, loss scaler, progress
    result = train_step(state, cfg, runtime, next(batches))   # train.py's step, state advanced
    save_checkpoint(directory, cfg, runtime, state)  # resumable by train.py, exactly
    load_checkpoint(directory, cfg, runtime, state)

Each is the function the trainer itself calls (dtgpt.distributed, dtgpt.parallel, dtgpt.step,
dtgpt.state, dtgpt.data, dtgpt.checkpoint): one code path for both. The checkpoint calls also
take a bare model and your own optimizer instead of a TrainState: then only the weights, the
optimizer moments and the RNG are saved, no LR schedule, loss scale or progress (they were not
dtgpt's), and train.py starts from such a checkpoint with checkpoint.load_optimizer=false.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator, Union

import torch

from dtgpt.config import Config, config_from_dict, derived, padded_vocabulary, validate
from dtgpt.data import build_data_loader, build_datasets, build_tokenizer
from dtgpt.data.batch import TokenOptions
from dtgpt.distributed import Runtime, initialize
from dtgpt.distributed import shutdown as shutdown  # re-exported
from dtgpt.model import GPT
from dtgpt.optim import BatchSizeSchedule, PartOptimizers
from dtgpt.parallel import ModelParts, ParallelDims
from dtgpt.parallel import build_model as build_parallel_model
from dtgpt.state import Progress, TrainState
from dtgpt.state import build_train_state as build_train_state  # re-exported
from dtgpt.step import StepResult, reduce_loss
from dtgpt.step import forward_backward as forward_backward_local


def make_config(**sections: dict) -> Config:
    """A validated Config from one dict per section (unknown keys are errors, as in TOML)."""
    cfg = config_from_dict(sections, "make_config")
    validate(cfg)
    return cfg


def init_distributed(cfg: Config) -> Runtime:
    """Start the process group when launched by torchrun, build the mesh of cfg.parallel, seed."""
    return initialize(cfg)


def _dims_for(cfg: Config, runtime: Runtime) -> ParallelDims:
    """The runtime's mesh when cfg has its layout, else a second mesh over the same ranks."""
    dims = ParallelDims.from_config(cfg, runtime.world_size)
    same = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (
        runtime.dims.pp, runtime.dims.dp_replicate, runtime.dims.dp_shard, runtime.dims.cp, runtime.dims.tp,
    )  # fmt: skip
    if same:
        return runtime.dims
    dims.build_mesh(runtime.device.type)
    return dims


def build_model(cfg: Config, runtime: Runtime, vocab_size: int) -> ModelParts:
    """GPT of cfg.model built on meta, parallelised per cfg.parallel, initialised with the seed."""
    padded = padded_vocabulary(cfg, vocab_size)
    with torch.device("meta"):
        whole = GPT(cfg.model, padded)
    return build_parallel_model(cfg, _dims_for(cfg, runtime), whole, runtime.device)


def num_microbatches(cfg: Config, runtime: Runtime) -> int:
    """Micro-batches per data-parallel rank in one global batch of cfg."""
    return derived.num_microbatches(cfg, runtime.dims.dp, cfg.training.global_batch_size)


def build_train_iterator(cfg: Config, runtime: Runtime, consumed_samples: int = 0) -> Iterator[torch.Tensor]:
    """This rank's (global batch size / dp, seq_length + 1) token batches, in the global order
    that train.py reads (batch-size ramp-up included), from consumed_samples on."""
    from dtgpt.training import num_samples_needed

    tokenizer = build_tokenizer(cfg.data)
    train, _, _ = build_datasets(cfg, tokenizer, num_samples_needed(cfg))
    size_at = BatchSizeSchedule(cfg.training).global_batch_size
    dims, options = runtime.dims, TokenOptions.from_config(cfg.data, tokenizer.eod)
    return iter(build_data_loader(train, consumed_samples, size_at, dims.dp_rank, dims.dp, cfg.data.num_workers, options))


def forward_backward(model: ModelParts, batch: torch.Tensor, num_microbatches: int, *, forward_only: bool = False) -> float:
    """Forward and backward over the micro-batches of one global batch (through the pipeline
    schedule when there is one); returns the global-batch loss, the same on every rank. The
    gradients of a tied embedding split across pipeline stages are summed, as train_step does."""
    local = forward_backward_local(model, batch, num_microbatches, forward_only=forward_only)
    if not forward_only:
        model.sync_tied_grads()
    return reduce_loss(model, local).item()


def train_step(state: TrainState, cfg: Config, runtime: Runtime, batch: torch.Tensor | None) -> StepResult:
    """train.py's training iteration on one global batch: set the LR, forward-backward, clip,
    AdamW step (skipped on overflow or a non-finite loss), then advance `state`'s progress and
    LR schedule. `result.nan` says the step was non-finite (train.py applies nan_policy)."""
    from dtgpt.training import build_trainer, step_state

    result, _, _ = step_state(build_trainer(cfg, runtime, state), batch)
    return result


ModelOrState = Union[TrainState, ModelParts]


def _as_state(model: ModelOrState, optimizer, iteration: int) -> TrainState:
    """A TrainState as is; a bare model (and optimizer) wrapped without schedule or scaler."""
    if isinstance(model, TrainState):
        return model
    if not isinstance(optimizer, PartOptimizers):
        optimizer = PartOptimizers.wrap([optimizer] if optimizer is not None else [])
    return TrainState(model, optimizer, lr_schedule=None, scaler=None, progress=Progress(iteration=iteration))


def save_checkpoint(
    directory: str | Path, cfg: Config, runtime: Runtime, model: ModelOrState, optimizer=None, iteration: int = 1
) -> Path:
    """Save a TrainState (or a model and optimizer) with DCP to directory/iter_NNNNNNN, as training
    does. A TrainState is saved at its own iteration, and train.py resumes from it exactly."""
    from dtgpt.checkpoint import Checkpointer
    from dtgpt.checkpoint.layout import iteration_dir

    state = _as_state(model, optimizer, iteration)
    # overwrite: the caller names this directory on each call, so earlier saves there are its own
    # (a re-saved iteration is still swapped in only once complete).
    run = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save=str(directory), load="", async_save=False, overwrite=True)
    )
    checkpointer = Checkpointer(state, run, runtime)
    checkpointer.save(state.progress.iteration)
    checkpointer.finalize()
    return iteration_dir(directory, state.progress.iteration)


def load_checkpoint(directory: str | Path, cfg: Config, runtime: Runtime, model: ModelOrState, optimizer=None) -> int:
    """Load the latest checkpoint under directory into a TrainState (everything, the RNG too) or a
    model (and optimizer), whatever mesh saved it; returns its iteration. Given a bare model
    without an optimizer, only the weights are read."""
    from dtgpt.checkpoint import Checkpointer
    from dtgpt.checkpoint.layout import read_pointer

    whole = isinstance(model, TrainState) or optimizer is not None
    run = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save="", load=str(directory), load_optimizer=whole)
    )
    state = _as_state(model, optimizer, 0)
    Checkpointer(state, run, runtime).restore_rng()
    # A weights-only load does not read the training state; the pointer names the iteration.
    return state.progress.iteration or (read_pointer(directory) or 0)
