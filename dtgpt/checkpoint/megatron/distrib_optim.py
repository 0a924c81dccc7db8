"""The distributed optimizer's `distrib_optim.pt` of Megatron-LM's per-rank format, mapped to the
parameters of the model_optim_rng.pt beside it.

Megatron-LM's legacy save (megatron/training/checkpointing.py) has every model-parallel rank call
save_parameter_state into its own mp_rank_* directory: its dp rank 0 gathers the rank's grad
buffers (get_parameter_state_dp_zero) and writes {"buckets_coalesced": True, <gbuf>: {(param
dtype, grad dtype): {"param", "exp_avg", "exp_avg_sq": flat fp32, "numel_unpadded"}}}, the
buckets back to back without their end padding; one gbuf per model chunk (with virtual pipeline
stages the file's model0, model1, ... in turn: a DDP each). A buffer holds exactly the
parameters of its chunk of that directory's model state: its pipeline stage's, each as its tp
shard (SwiGLU's linear_fc1 as [its gate rows; its up rows], as the weights), in the file's order (megatron-core's module order)
reversed, each at a multiple of 64 elements within its bucket (buckets.fit). Where a bucket ends
is not stored; megatron-core's DDP (param_and_grad_buffer) closes one

  - once it reaches the bucket size, which it uses only with --overlap-grad-reduce, on pipeline
    rank 0's first chunk, and without --overlap-param-gather-with-optimizer-step:
    --ddp-bucket-size, or the parameters over --ddp-num-buckets (newer Megatron-LM), or max(40M, 1M x the dp size; the
    current source counts dp x cp);
  - before and after a parameter marked shared_embedding: at pp > 1, the first stage's word
    embedding and the last stage's copy of it (output_layer.weight) when the head is tied (the
    first stage's also with MTP), so that both stages shard it alike over dp.

Each bucket size that can apply is tried; the one whose buckets add up to numel_unpadded and
whose master weights equal the file's weights (first and last element of each parameter) is
taken. Several grad buffers to a chunk (MoE experts, mixed dtypes) are not mapped.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dtgpt.checkpoint.megatron.buckets import aligned, fit
from dtgpt.checkpoint.megatron.formats import load_pickle

DISTRIB_OPTIM_FILE = "distrib_optim.pt"
DEFAULT_BUCKET_SIZE = 40_000_000
"""megatron-core DDP's bucket size with overlap_grad_reduce and no --ddp-bucket-size (at least 1e6 x dp)."""
SHARED_EMBEDDING = ("embedding.word_embeddings.weight", "output_layer.weight")
"""The parameters megatron-core may mark shared_embedding (a tied pipeline's two copies of the embedding)."""

Slots = dict[str, torch.Tensor]  # slot -> a parameter's tensor


class Unmapped(Exception):
    """The optimizer state of a file that dtgpt does not map: the message says why."""


def bucket_lengths(numels: list[int], bucket_size: int | None, own_bucket: frozenset[int] = frozenset()) -> list[int]:
    """The unpadded length of each bucket of megatron-core's grad buffer (param_and_grad_buffer):
    the parameters in reverse, each aligned, a bucket closed once it reaches `bucket_size`, and
    the parameters at `own_bucket` (their positions) each in a bucket of its own."""
    lengths, position = [], 0
    for index in reversed(range(len(numels))):
        position = aligned(position)
        if index in own_bucket and position:
            lengths.append(position)
            position = 0
        position += numels[index]
        if index in own_bucket or (bucket_size is not None and position >= bucket_size):
            lengths.append(position)
            position = 0
    return lengths + ([position] if position else [])


def bucket_sizes(args, numel: int, pp_rank: int, chunk: int = 0) -> list[int | None]:
    """The bucket sizes megatron-core's DDP may have used for model chunk `chunk` of a pipeline
    rank, holding `numel` parameters, given Megatron-LM's saved args: None is one bucket."""
    said = lambda name, default=None: getattr(args, name, None) or default  # noqa: E731
    if not said("overlap_grad_reduce") or pp_rank > 0 or chunk > 0 or said("overlap_param_gather_with_optimizer_step"):
        return [None]
    if said("ddp_num_buckets"):
        return [numel // args.ddp_num_buckets]
    if said("ddp_bucket_size"):
        return [args.ddp_bucket_size]
    dp = said("data_parallel_size", 1)
    return list(dict.fromkeys(max(DEFAULT_BUCKET_SIZE, 1_000_000 * n) for n in (dp, dp * said("context_parallel_size", 1))))


def own_buckets(keys: list[str], args, pp: int) -> frozenset[int]:
    """The positions of the parameters megatron-core marks shared_embedding (see the module doc)."""
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    shared = {SHARED_EMBEDDING[0]} if tied or getattr(args, "mtp_num_layers", None) else set()
    shared |= {SHARED_EMBEDDING[1]} if tied else set()
    return frozenset(i for i, key in enumerate(keys) if pp > 1 and key in shared)


def candidate_cuts(params: list[tuple[str, torch.Tensor]], args, pp: int, pp_rank: int, chunk: int = 0) -> list[list[int]]:
    """The bucket lengths megatron-core's DDP may have cut the buffer of model chunk `chunk` of a
    file, holding `params` (key, weight), into: one list per bucket size its args allow."""
    numels = [value.numel() for _, value in params]
    own = own_buckets([key for key, _ in params], args, pp)
    return [bucket_lengths(numels, size, own) for size in bucket_sizes(args, sum(numels), pp_rank, chunk)]


def distributed_slots(path: Path, chunks: list[list[tuple[str, torch.Tensor]]], args, pp: int, pp_rank: int) -> list[Slots]:
    """Each parameter's {"param", "exp_avg", "exp_avg_sq"} from the distrib_optim.pt at `path` of
    a file holding `chunks` (each a model chunk's (key, weight) in its order; one without virtual
    pipeline stages), saved on pipeline rank `pp_rank` of `pp`, in that order, or Unmapped."""
    state = load_pickle(path, mmap=True)
    buffers = sorted(key for key in state if isinstance(key, int))
    if not state.get("buckets_coalesced") or buffers != list(range(len(chunks))) or any(len(state[b]) != 1 for b in buffers):
        plural = "s" if len(chunks) > 1 else ""
        raise Unmapped(f"has a {DISTRIB_OPTIM_FILE} of {len(buffers)} grad buffers for {len(chunks)} model chunk{plural}, "
                       "or several dtypes in one (MoE experts, mixed parameter dtypes), or buckets not coalesced (older Megatron), "
                       "which dtgpt does not map")  # fmt: skip
    return [slots for b, params in enumerate(chunks) for slots in buffer_slots(next(iter(state[b].values())), params, args, pp, pp_rank, b)]


def buffer_slots(flat: dict, params: list[tuple[str, torch.Tensor]], args, pp: int, pp_rank: int, chunk: int) -> list[Slots]:
    """Each parameter's slots out of one grad buffer's coalesced state `flat`, that of model chunk
    `chunk` holding `params`, or Unmapped."""
    tried = []
    for lengths in candidate_cuts(params, args, pp, pp_rank, chunk):
        places = fit([((p, None), value.numel()) for p, (_, value) in enumerate(params)], [(str(b), n) for b, n in enumerate(lengths)])
        tried.append(f"{sum(lengths)} in {len(lengths)} bucket{'s' if len(lengths) > 1 else ''}")
        if places is not None and sum(lengths) == flat["numel_unpadded"]:
            starts = [sum(lengths[:b]) for b in range(len(lengths))]
            slots = [_slots(flat, starts[int(places[(p, None)][0])] + places[(p, None)][1], value) for p, (_, value) in enumerate(params)]
            if all(_master_agrees(s["param"], value) for s, (_, value) in zip(slots, params)):
                return slots
            tried[-1] += " (its master weights differ from the weights)"
    raise Unmapped(f"has a {DISTRIB_OPTIM_FILE} whose grad buffer {chunk} holds {flat['numel_unpadded']} elements, but the "
                   f"parameters of model chunk {chunk} laid out as megatron-core's buffer take {', or '.join(tried)}")  # fmt: skip


def _slots(flat: dict, at: int, value: torch.Tensor) -> Slots:
    return {slot: flat[slot][at : at + value.numel()].view(value.shape) for slot in ("param", "exp_avg", "exp_avg_sq")}


def _master_agrees(master: torch.Tensor, weight: torch.Tensor) -> bool:
    """The first and last element of a parameter's fp32 master weight, cast to the weight's dtype,
    equal its weight's: two elements a parameter, read from the memory-mapped files."""
    return torch.equal(master.flatten()[[0, -1]].to(weight.dtype), weight.flatten()[[0, -1]])
