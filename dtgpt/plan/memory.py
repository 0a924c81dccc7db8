"""The planner's formulas: micro-batches in flight, bubble, model-state bytes, time.

Pure arithmetic on numbers the planner read from the real parallelised model (dtgpt.plan.layout);
nothing here touches torch.distributed. Every formula is written out in docs/plan.md; the
activations of one layer are dtgpt.plan.activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtgpt.config import MULTI_STAGE_SCHEDULES, interleaved_round_size
from dtgpt.config.muon_keys import MUON_OPTIMIZERS

GIB = 2**30
SECONDS_PER_DAY = 86400.0


def chunks_in_flight(schedule: str, pp: int, pp_rank: int, stages_per_rank: int, microbatches: int) -> int:
    """How many (micro-batch, stage) activation sets a pp rank holds at its peak.

    GPipe, LoopedBFS   every micro-batch of every local stage: m·v
    1F1B               pp - pp_rank micro-batches (the first stage pp, the last 1), at most m
    interleaved        Megatron's warm-up count + 1: 2·(pp - pp_rank - 1) + (v - 1)·g + 1 chunks,
                       at most m·v, with rounds of g micro-batches (g = pp when pp divides m;
                       config.derived.interleaved_round_size); assumed for the zero-bubble and
                       V-shaped schedules too
    """
    v, m = stages_per_rank, microbatches
    if pp == 1:
        return 1
    if schedule in ("GPipe", "LoopedBFS"):
        return m * v
    if schedule not in MULTI_STAGE_SCHEDULES:
        return min(pp - pp_rank, m)
    return min(2 * (pp - pp_rank - 1) + (v - 1) * interleaved_round_size(m, pp) + 1, m * v)


def pipeline_buffers(stage_ids: list[int], num_stages: int) -> int:
    """Receive buffers a pp rank's stages hold at their peak, each one boundary activation
    (b·s·h, s/tp under SP, s/cp under cp): per held stage one for the activation it receives
    (all but the first stage) and one for the gradient it receives (all but the last).

    A buffer lives from its receive until the forward or backward that reads it
    (dtgpt.parallel.pipeline_buffers), whatever the micro-batch count; what a received activation
    keeps for backward after that is the first block's input, counted with the activations.
    torch's own stages kept both for every micro-batch: 2·m per stage.
    """
    if num_stages == 1:
        return 0
    return sum((stage != 0) + (stage != num_stages - 1) for stage in stage_ids)


def bubble_fraction(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """Idle fraction of an iteration: (p-1)/(m+p-1); interleaved schedules cut the bubble time
    by v, giving (p-1)/(v·m+p-1). Zero-bubble schedules fill part of it: an upper bound there."""
    if pp == 1 or microbatches <= 0:
        return 0.0
    v = stages_per_rank if schedule in MULTI_STAGE_SCHEDULES and schedule != "LoopedBFS" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


@dataclass
class StateBytes:
    """Model-state bytes on one rank (the activation terms are added by the planner)."""

    params: float
    """The fp32 parameters the optimizer updates (the master weights under fp16/bf16)."""
    copies: float
    """Compute copies: FSDP's gathered parameters, in the compute dtype."""
    grads: float
    adam: float
    """The optimizer's state (the term keeps its name when optimizer.optimizer = "sgd" or "muon"):
    optimizer_bytes per parameter it holds."""


def optimizer_bytes(optimizer: str, sgd_momentum: float, muon_share: float = 0.0) -> float:
    """fp32 optimizer-state bytes per parameter: Adam's m and v, SGD's momentum buffer (none
    without momentum); under Muon, one momentum buffer for the `muon_share` of the parameters
    that are its matrices and AdamW's m and v for the rest."""
    if optimizer == "sgd":
        return 4 if sgd_momentum else 0
    if optimizer in MUON_OPTIMIZERS:
        return 4 * muon_share + 8 * (1 - muon_share)
    return 8


def state_bytes(
    local_params: int,
    unsharded_params: int,
    largest_unit: int,
    *,
    compute_bytes: int,
    grad_bytes: int,
    fsdp: bool,
    pipelined: bool,
    reshard_after_forward: bool,
    accumulates: bool = False,
    compute_copy: bool = False,
    state_per_param: float = 8,
) -> StateBytes:
    """Bytes of parameters, compute copies, gradients and Adam m, v on one rank.

    local_params      what the rank's optimizer holds (the dp shard under FSDP)
    unsharded_params  the same parameters gathered over dp (tp-sharded only)
    largest_unit      the largest FSDP unit (a block), gathered over dp
    compute_bytes     2 under fp16/bf16, 4 in fp32
    grad_bytes        what gradients accumulate and reduce in (config.grads_reduced_in_fp32)
    state_per_param   the optimizer's bytes per parameter (optimizer_bytes: 8 for Adam)

    The fp32 parameters, gradients and Adam state are the master, dp shards under FSDP (an fp16
    or bf16 run is FSDP-sharded wherever dp x cp > 1: dtgpt/parallel/fsdp.py). FSDP
    gathers the parameters per unit in the compute dtype: about two units at a time (the running
    one and the prefetched one) when units reshard after forward, all of them otherwise. Backward
    gives each unit's gradients in the compute dtype, reduce-scattered from a grad_bytes buffer;
    with more than one micro-batch per iteration (`accumulates`), and always under pipelining,
    every unit's gradient stays unsharded, accumulated in grad_bytes, until the last micro-batch's
    one reduce-scatter (gradient sync is off before).

    fp16/bf16 at dp x cp = 1 (`compute_copy`, dtgpt/parallel/compute_copy.py) holds the fp32
    masters and their gradients, a compute-dtype copy of every parameter and a compute-dtype
    buffer its backward fills, all for the whole run.
    """
    if compute_copy:
        n = local_params
        return StateBytes(params=4 * n, copies=compute_bytes * n, grads=(4 + compute_bytes) * n, adam=state_per_param * n)
    if not fsdp:  # fp32 at dp = cp = 1
        return StateBytes(params=4 * local_params, copies=0, grads=4 * local_params, adam=state_per_param * local_params)
    gathered = unsharded_params if pipelined or not reshard_after_forward else 2 * largest_unit
    if pipelined or accumulates:
        unsharded_grads = grad_bytes * unsharded_params
    else:
        unsharded_grads = (compute_bytes + grad_bytes) * largest_unit
    return StateBytes(
        params=4 * local_params,
        copies=compute_bytes * gathered,
        grads=4 * local_params + unsharded_grads,
        adam=state_per_param * local_params,
    )


# -- time ------------------------------------------------------------------------------------


def hardware_flops_per_token(model_flops: float, recomputed_layers: int, layer_flops: float) -> float:
    """Model FLOPs plus one more forward (a third of forward + backward) per recomputed layer."""
    return model_flops + recomputed_layers * layer_flops / 3


def training_seconds(tokens: float, flops_per_token: float, num_gpus: int, tflops_per_gpu: float) -> float:
    """tokens · FLOPs per token / (n · X): X is the throughput each GPU achieves, bubble included."""
    return tokens * flops_per_token / (num_gpus * tflops_per_gpu * 1e12)


def classic_training_days(
    tokens: float, params: float, num_gpus: int, tflops_per_gpu: float, recompute: bool = True
) -> float:
    """Narayanan et al. (2021), eq. 4: end-to-end time ≈ 8·T·P/(n·X) with full recomputation
    (6·T·P/(n·X) without); 300B tokens of GPT-3 175B on 1024 GPUs at 140 TFLOP/s: ~34 days."""
    factor = 8 if recompute else 6
    return factor * tokens * params / (num_gpus * tflops_per_gpu * 1e12) / SECONDS_PER_DAY
