"""The model-parallel RNG: Megatron's dropout semantics under tensor and sequence parallelism.

Two random streams per rank, as in Megatron-LM:

default         torch's own generator, seeded `seed + 100 * pp_rank` (pipeline stages differ;
                tp and dp peers of a stage share it). Dropout on activations every tp rank
                holds in full (the embedding's dropout, hidden dropout without sequence
                parallelism) draws here, so all tp ranks draw the same mask for the same values.
model-parallel  one generator per tp rank, seeded `seed + 100 * pp_rank + 2718 + tp_rank`.
                Dropout on what a tp rank holds alone (attention dropout on its own heads,
                hidden dropout on its sequence-parallel chunk) draws here, forked around the op,
                so tp ranks draw independent masks, as different slices of one model would.

The streams are installed only when tp > 1: with one tp rank every region is replicated.
A checkpoint stores both states per (pp, tp) coordinate; on a mesh with other stages or another
tp size both are re-seeded from (seed, pp_rank, tp_rank, iteration) by the rule below.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from dtgpt.model import GPT, CoreAttention
from dtgpt.mtp import numbered_blocks
from dtgpt.parallel.dims import ParallelDims

MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset of the tensor-parallel seed


def stage_seed(seed: int, pp_rank: int, iteration: int = 0) -> int:
    """The default generator's seed: at start-up (iteration 0), or re-derived at `iteration`
    when a checkpoint's states do not apply to this mesh."""
    return seed + 100 * pp_rank + 1_000_003 * iteration


def model_parallel_seed(seed: int, pp_rank: int, tp_rank: int, iteration: int = 0) -> int:
    return stage_seed(seed, pp_rank, iteration) + MODEL_PARALLEL_SEED_OFFSET + tp_rank


def rng_coordinate(dims: ParallelDims) -> str:
    """The checkpoint name of a rank's generator states: its (pp, tp) coordinate."""
    return f"pp_{dims.pp_rank}.tp_{dims.tp_rank}"


def _default_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_default_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class ModelParallelRNG:
    """This rank's model-parallel generator state, swapped in around tensor-parallel dropout."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.state = torch.empty(0, dtype=torch.uint8)
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self.state = generator.get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on the model-parallel stream; the default stream is left untouched.

        Swapping the state into the device's default generator (rather than passing a generator)
        reaches kernels that take none, such as scaled_dot_product_attention's dropout.
        """
        default = _default_state(self.device)
        _set_default_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = _default_state(self.device)
            _set_default_state(default, self.device)

    def recompute_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(forward, recompute) contexts for torch.utils.checkpoint's `context_fn`.

        Checkpointing replays the default generator by itself; this replays the model-parallel
        one, so a recomputed tp-region dropout draws the mask its forward drew, and leaves the
        stream where the forward left it.
        """
        at_forward = self.state.clone()

        @contextlib.contextmanager
        def replay() -> Iterator[None]:
            after = self.state
            self.state = at_forward.clone()
            try:
                yield
            finally:
                self.state = after

        return contextlib.nullcontext(), replay()


def apply_rng_streams(model: GPT, rng: ModelParallelRNG, sequence_parallel: bool) -> None:
    """Draw tp-region dropout (local attention heads; sequence-parallel chunks) from `rng`."""
    for module in model.modules():
        if isinstance(module, CoreAttention):
            module.stream = rng.fork
    if sequence_parallel:
        for block in numbered_blocks(model).values():
            block.dropout.stream = block.mlp_dropout.stream = rng.fork

