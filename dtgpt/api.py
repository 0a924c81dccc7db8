"""dtgpt as a library: the building blocks that train.py's pretrain() is made of, for a loop of your own.

    cfg = make_config(model={...}, parallel={"tensor_model_parallel_size": 2}, ...)
    runtime = init_distributed(cfg)                  # process group, mesh, device, seeds
    model = build_model(cfg, runtime, vocab_size)    # this rank's parallelised model parts
    batches = build_train_iterator(cfg, model)       # this model's share of each global batch
    loss = forward_backward(model, next(batches), num_microbatches(cfg, model.dims.dp))

    state = build_train_state(cfg, model)            # AdamW, LR schedule, loss scaler, progress
    result = train_step(cfg, state, next(batches))   # train.py's iteration, state advanced
    save_checkpoint(directory, cfg, runtime, state)  # resumable by train.py, exactly
    load_checkpoint(directory, cfg, runtime, state)

Data and micro-batch counts follow the model's own mesh (`model.dims`): a model built from a
config with another layout than the runtime's gets a mesh of its own over the same ranks, and
reads its batches by that mesh's data-parallel rank.
The trainer (dtgpt.training) is one user of these: it calls the same functions, and nothing here
imports it. Defined here are the compositions of the lower modules; the rest is re-exported
from where it lives (dtgpt.distributed, dtgpt.state, dtgpt.step, dtgpt.config). The checkpoint
calls also take a bare model and your own optimizer instead of a TrainState: then only the
weights, the optimizer moments and the RNG are saved, no LR schedule, loss scale or progress
(they were not dtgpt's), and train.py starts from such a checkpoint with
checkpoint.load_optimizer=false.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Callable, Iterable, Iterator, Union

import torch

from dtgpt.config import Config, config_from_dict, padded_vocabulary, validate
from dtgpt.config.batch_schedule import BatchSizeSchedule, total_train_samples, train_iterations
from dtgpt.config import num_microbatches as num_microbatches  # re-exported
from dtgpt.data import build_datasets, build_tokenizer
from dtgpt.data.batch import TokenOptions
from dtgpt.data.loader import build_data_loader
from dtgpt.distributed import Runtime
from dtgpt.distributed import init_distributed as init_distributed  # re-exported
from dtgpt.distributed import shutdown as shutdown  # re-exported
from dtgpt.model import GPT
from dtgpt.optim import PartOptimizers
from dtgpt.parallel import ModelParts, ParallelDims, build_model_parts
from dtgpt.state import Progress, TrainState
from dtgpt.state import build_train_state as build_train_state  # re-exported
from dtgpt.step import evaluate as evaluate  # re-exported
from dtgpt.step import forward_backward as forward_backward  # re-exported
from dtgpt.step import train_step as train_step  # re-exported

ModelProvider = Callable[[Config, int], GPT]
"""(config, padded vocabulary size) -> the whole GPT; called under torch.device("meta")."""

__all__ = [
    "make_config", "init_distributed", "build_model", "build_train_state", "build_train_iterator",
    "build_data_iterators", "num_samples_needed", "num_microbatches", "forward_backward", "train_step",
    "evaluate", "save_checkpoint", "load_checkpoint", "shutdown",
]  # fmt: skip


def make_config(**sections: dict) -> Config:
    """A validated Config from one dict per section (unknown keys are errors, as in TOML)."""
    cfg = config_from_dict(sections, "make_config")
    validate(cfg)
    return cfg


def _dims_for(cfg: Config, runtime: Runtime) -> ParallelDims:
    """The runtime's mesh when cfg has its layout, else a second mesh over the same ranks."""
    dims = ParallelDims.from_config(cfg, runtime.world_size)
    if (dims.shape, dims.ep) == (runtime.dims.shape, runtime.dims.ep):  # ep's meshes are built with the rest
        return dataclasses.replace(runtime.dims, low_precision=dims.low_precision)
    dims.build_mesh(runtime.device.type)
    return dims


def gpt_from_config(cfg: Config, vocab_size: int) -> GPT:
    """The default model provider: the GPT of cfg.model."""
    return GPT(cfg.model, vocab_size)


def build_model(cfg: Config, runtime: Runtime, vocab_size: int, model_provider: ModelProvider = gpt_from_config) -> ModelParts:
    """The provider's GPT built on meta, parallelised per cfg.parallel, initialised with the seed.
    `vocab_size` is the tokenizer's; it is padded here (make_vocab_size_divisible_by)."""
    with torch.device("meta"):
        whole = model_provider(cfg, padded_vocabulary(cfg, vocab_size))
    return build_model_parts(cfg, _dims_for(cfg, runtime), whole, runtime.device)


def num_samples_needed(cfg: Config) -> tuple[int, int, int]:
    """Samples of train, valid and test that the run will read (Megatron's accounting)."""
    t, e = cfg.training, cfg.eval
    evals = 1 if e.skip_train else train_iterations(t, cfg.model.seq_length) // e.eval_interval + 1
    return total_train_samples(t, cfg.model.seq_length), evals * e.eval_iters * t.global_batch_size, e.eval_iters * t.global_batch_size


def resumed_valid_samples(cfg: Config, progress: Progress) -> int:
    """Where the validation stream stands at `progress`: its consumed_valid_samples, or, for a
    checkpoint that holds none (older dtgpt, or 0 in a Megatron one), Megatron's backward-compatible
    count: one evaluation of eval_iters global batches every eval_interval iterations so far. Under
    eval.skip_train validation reads from its first sample, as Megatron's does then."""
    if cfg.eval.skip_train:
        return 0
    if progress.consumed_valid_samples or not progress.iteration:
        return progress.consumed_valid_samples
    return progress.iteration // cfg.eval.eval_interval * cfg.eval.eval_iters * cfg.training.global_batch_size


def _cycle(make: Callable[[int], Iterable], start: int) -> Iterator:
    """Loop over a finite loader forever, the first pass from sample `start`, then from 0
    (evaluation reads a fixed number of batches each time)."""
    while True:
        empty = True
        for item in make(start):
            empty = False
            yield item
        if empty:
            return
        start = 0


Reader = Union[ModelParts, ParallelDims]
"""Who reads the batches: the model (its mesh, and whether this rank's stages take any), or a mesh."""


def _reader_dims(reader: Reader, caller: str) -> tuple[ParallelDims, bool]:
    """The mesh whose data-parallel rank picks the samples, and whether this rank reads any."""
    if isinstance(reader, ModelParts):
        return reader.dims, reader.reads_batches
    if isinstance(reader, ParallelDims):
        return reader, True
    raise TypeError(
        f"{caller} takes the model that reads the batches (dtgpt.build_model's result) or its mesh, not "
        f"{type(reader).__name__}: a model built from a config with another layout has a mesh of its own"
    )


def build_data_iterators(
    cfg: Config, reader: Reader, datasets: tuple, options: TokenOptions, consumed_samples: int = 0,
    consumed_valid_samples: int = 0,
) -> tuple[Iterator, Iterator | None, Iterator | None]:
    """Train, validation and test iterators of the Batches `reader` (a model, or a mesh) reads on
    this rank: its mesh's data-parallel share of each global batch. The train one is in the global
    order from consumed_samples on (batch-size ramp-up included); validation continues from
    consumed_valid_samples as an uninterrupted run would (Megatron's consumed_valid_samples), test
    starts at 0; both wrap around. A middle pipeline stage that needs no per-token inputs reads
    none: it gets None per batch and starts no loader workers."""
    dims, reads_batches = _reader_dims(reader, "build_data_iterators")
    train_ds, valid_ds, test_ds = datasets
    if not reads_batches:
        nothing = itertools.repeat(None)
        return nothing, nothing if valid_ds is not None else None, nothing if test_ds is not None else None
    workers, eval_size = cfg.data.num_workers, cfg.training.global_batch_size

    def loader(dataset, start, size_at):
        return build_data_loader(dataset, start, size_at, dims.dp_rank, dims.dp, workers, options)

    def evaluation(dataset, consumed: int) -> Iterator | None:
        if dataset is None:
            return None
        # An uninterrupted stream wraps after its last whole global batch: resume at the same place.
        period = len(dataset) // eval_size * eval_size
        return _cycle(lambda start: loader(dataset, start, lambda _: eval_size), consumed % period if period else 0)

    train = iter(loader(train_ds, consumed_samples, BatchSizeSchedule(cfg.training, cfg.model.seq_length).global_batch_size))
    return train, evaluation(valid_ds, consumed_valid_samples), evaluation(test_ds, 0)


def build_train_iterator(cfg: Config, reader: Reader, consumed_samples: int = 0) -> Iterator:
    """The Batches `reader` (the model, or a mesh) reads on this rank, (global batch size / its
    dp) samples each, in the global order that train.py reads (batch-size ramp-up included), from
    consumed_samples on."""
    _reader_dims(reader, "build_train_iterator")
    tokenizer = build_tokenizer(cfg.data)
    datasets = build_datasets(cfg, tokenizer, num_samples_needed(cfg))
    options = TokenOptions.from_config(cfg.data, tokenizer.eod)
    return build_data_iterators(cfg, reader, datasets, options, consumed_samples)[0]


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
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save="", load=str(directory), load_optimizer=whole, finetune=False, load_rng=True)
    )
    state = _as_state(model, optimizer, 0)
    Checkpointer(state, run, runtime).restore_rng()
    # A weights-only load does not read the training state; the pointer names the iteration.
    return state.progress.iteration or (read_pointer(directory) or 0)
