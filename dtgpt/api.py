"""dtgpt as a library: the calls that train.py's pretrain() is made of, for a loop of your own.

    cfg = make_config(model={...}, parallel={"tensor_model_parallel_size": 2}, ...)
    runtime = init_distributed(cfg)                  # process group, mesh, device, seeds
    model = build_model(cfg, runtime, vocab_size)    # this rank's parallelised model parts
    batches = build_train_iterator(cfg, runtime)     # this rank's share of each global batch
    loss = forward_backward(model, next(batches), num_microbatches(cfg, runtime))
    save_checkpoint(directory, cfg, runtime, model, optimizer, iteration)
    load_checkpoint(directory, cfg, runtime, model, optimizer)

Each is the function the trainer itself calls (dtgpt.distributed, dtgpt.parallel, dtgpt.step,
dtgpt.data, dtgpt.checkpoint): one code path for both.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import torch

from dtgpt.config import Config, config_from_dict, derived, padded_vocabulary, validate
from dtgpt.data import build_data_loader, build_datasets, build_tokenizer
from dtgpt.distributed import Runtime, initialize
from dtgpt.distributed import shutdown as shutdown  # re-exported
from dtgpt.loss_scaler import build_loss_scaler
from dtgpt.model import GPT, flops_per_token
from dtgpt.optim import BatchSizeSchedule, LRSchedule, PartOptimizers
from dtgpt.parallel import ModelParts, ParallelDims
from dtgpt.parallel import build_model as build_parallel_model
from dtgpt.step import forward_backward as forward_backward_local
from dtgpt.step import reduce_loss


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
    same = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (
        runtime.dims.pp, runtime.dims.dp_replicate, runtime.dims.dp_shard, runtime.dims.tp,
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
    """This rank's (global_batch_size / dp, seq_length + 1) token batches, in the global order."""
    tokenizer = build_tokenizer(cfg.data)
    samples = (consumed_samples + cfg.training.train_iters * cfg.training.global_batch_size, 0, 0)
    train, _, _ = build_datasets(cfg, tokenizer, samples)
    size = cfg.training.global_batch_size
    dims = runtime.dims
    return iter(build_data_loader(train, consumed_samples, lambda _consumed: size, dims.dp_rank, dims.dp, cfg.data.num_workers))


def forward_backward(model: ModelParts, batch: torch.Tensor, num_microbatches: int, *, forward_only: bool = False) -> float:
    """Forward and backward over the micro-batches of one global batch (through the pipeline
    schedule when there is one); returns the global-batch loss, the same on every rank."""
    local = forward_backward_local(model, batch, num_microbatches, forward_only=forward_only)
    return reduce_loss(model, local).item()


def _trainer(cfg: Config, runtime: Runtime, model: ModelParts, optimizer, iteration: int):
    """The trainer's own record of a run, around a model and optimizer built by the caller."""
    from dtgpt.training import Trainer, TrainState

    if not isinstance(optimizer, PartOptimizers):
        optimizer = PartOptimizers.wrap([optimizer] if optimizer is not None else [])
    vocab = model.parts[0].vocab_size
    trainer = Trainer(
        cfg, runtime, model, optimizer, LRSchedule(cfg), build_loss_scaler(cfg), BatchSizeSchedule(cfg.training),
        TrainState(iteration=iteration), flops_per_token(cfg.model, vocab),
    )  # fmt: skip
    return trainer


def save_checkpoint(directory: str | Path, cfg: Config, runtime: Runtime, model: ModelParts, optimizer=None, iteration: int = 1) -> Path:
    """Save model (and optimizer) state with DCP to directory/iter_NNNNNNN, as training does."""
    from dtgpt.checkpoint import Checkpointer
    from dtgpt.checkpoint.layout import iteration_dir

    run = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save=str(directory), load="", async_save=False))
    checkpointer = Checkpointer(_trainer(run, runtime, model, optimizer, iteration))
    checkpointer.save(iteration)
    checkpointer.finalize()
    return iteration_dir(directory, iteration)


def load_checkpoint(directory: str | Path, cfg: Config, runtime: Runtime, model: ModelParts, optimizer=None) -> int:
    """Load the latest checkpoint under directory into model (and optimizer), whatever mesh saved
    it; returns its iteration. Without an optimizer only the weights are read."""
    from dtgpt.checkpoint import Checkpointer

    run = dataclasses.replace(
        cfg,
        checkpoint=dataclasses.replace(cfg.checkpoint, save="", load=str(directory), load_optimizer=optimizer is not None),
    )
    from dtgpt.checkpoint.layout import read_pointer

    trainer = _trainer(run, runtime, model, optimizer, 0)
    Checkpointer(trainer).restore_rng()
    # A weights-only load does not read the training state; the pointer names the iteration.
    return trainer.state.iteration or (read_pointer(directory) or 0)
