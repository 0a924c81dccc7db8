"""ModelParts: what one rank holds of the parallel model, and how to run it.

One part without pipelining, one or more pipeline stages with it. The object hides that
difference from the trainer: it knows the loss (vocabulary-parallel under tp), which
parameters count toward the gradient norm, the per-micro-batch-count schedules, and how to
build the loss of one global batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtgpt.data.batch import IGNORE_INDEX
from dtgpt.model import GPT
from dtgpt.moe.stats import RoutingStats
from dtgpt.mtp import MTPLoss, with_added_gradient
from dtgpt.parallel.compute_copy import ComputeCopy
from dtgpt.parallel.dims import ParallelDims
from dtgpt.parallel.grad_bucket import reduce_pending_grads_bucketed
from dtgpt.parallel.rng import ModelParallelRNG
from dtgpt.parallel.tied import align_grad_placement, check_tied_copies, sync_tied_grads, tied_pair_on_rank
from dtgpt.parallel.vocab_parallel_loss import vocab_parallel_loss


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses, computed in fp32, skipping labels equal to IGNORE_INDEX."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def low_precision_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """As cross_entropy_sum, from the fp16/bf16 logits as they are (fp16_lm_cross_entropy)."""
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return losses.float().sum()


def build_cross_entropy(
    compiled: bool, in_fp32: bool = True, vocab_parallel: bool = False
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`vocab_parallel`: the logits come sharded over the vocabulary (loss parallelism under tp):
    Megatron's vocabulary-parallel loss (dtgpt/parallel/vocab_parallel_loss.py)."""
    if vocab_parallel:
        loss = vocab_parallel_loss(in_fp32)
    else:
        loss = cross_entropy_sum if in_fp32 else low_precision_cross_entropy_sum
    # Compiled, the fp32 upcast and log-softmax of the (tokens x vocabulary) logits fuse
    # instead of materialising an fp32 copy of them. The low-precision loss stays eager: inductor
    # keeps fp32 between ops, so compiled it skipped the rounding of each token's loss to the
    # logits' dtype (16 bf16 tokens: 159.766 against eager's 159.844), and its
    # emulate_precision_casts did not restore it (torch 2.11: no rounding; 2.13: another ulp).
    # Eager makes no fp32 copy there either: the log-softmax is in the logits' dtype.
    return torch.compile(loss) if compiled and in_fp32 else loss


@dataclass(frozen=True)
class GlobalBatchLoss:
    """loss(micro-batch) = sum of its token losses / loss tokens in the whole global batch.

    Summing this over micro-batches and data-parallel ranks gives the global-batch mean exactly,
    whatever the layout (not a mean of means). `scale` is the fp16 loss scale. One is built per
    global batch (its denominator is that batch's), and never changed.

    With `count_column` (training.calculate_per_token_loss=false) the labels carry one more
    column, the loss tokens of the row's micro-batch, which multiplies the denominator: the
    micro-batch's own count comes with its labels, however a schedule orders or repeats its
    loss calls (a pipeline schedule's first step also calls it on stand-in outputs).
    """

    denominator: torch.Tensor
    scale: float
    cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
    count_column: bool = False
    mtp: MTPLoss | None = None
    """With multi-token prediction, the model's output is (logits, each depth's logits): their
    term joins the gradient, not the value (dtgpt/mtp.py)."""

    def __post_init__(self) -> None:
        # Once per global batch, not per micro-batch (the same value: six ops fewer per loss).
        if not self.count_column:
            object.__setattr__(self, "_factor", self._scaled_inverse(self.denominator))

    def _scaled_inverse(self, denominator: torch.Tensor) -> torch.Tensor:
        # scale / d is d.reciprocal() * scale (torch's own definition, so bitwise the same); with
        # the scale at 1 (no fp16 loss scaling) one op instead of six (the float's conversion).
        return denominator.reciprocal() if self.scale == 1.0 else self.scale / denominator

    def __call__(self, logits: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        depth_logits = []
        if isinstance(logits, (tuple, list)):
            logits, *depth_logits = logits
        if self.count_column:
            factor = self._scaled_inverse(self.denominator * labels[0, -1].clamp(min=1))  # >= 1, as Megatron
            labels = labels[:, :-1]
        else:
            factor = self._factor
        loss = self.cross_entropy(logits, labels) * factor
        if depth_logits and self.mtp is not None:
            extra = self.mtp.term(depth_logits, labels, self.cross_entropy, self.denominator, self.count_column)
            loss = with_added_gradient(loss, extra * self.scale)
        return loss


@dataclass
class ModelParts:
    parts: list[GPT]
    stage_ids: list[int]
    num_stages: int
    dims: ParallelDims
    device: torch.device
    schedules: object | None  # ScheduleCache under pipeline parallelism
    tied_group: dist.ProcessGroup | None
    cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
    rng: ModelParallelRNG | None = None
    """The model-parallel dropout stream (under tp; dtgpt.parallel.rng)."""
    compute_copies: tuple[ComputeCopy, ...] = ()
    """fp16/bf16 where dp x cp = 1: per part, the compute-dtype copy that runs it (parallel/compute_copy.py)."""
    token_index: bool = False
    """The parts take token_index, each token's index in the run (layout-invariant dropout keys
    its masks on it): dtgpt.step builds it for every batch."""
    grad_reduce_dtype: torch.dtype = torch.float32
    """What gradients cross ranks in (config.grads_reduced_in_fp32): FSDP's reduction, the tied copies' sum."""
    fsdp_reshard_every_micro_batch: bool = False
    """parallel.fsdp_reshard_after_forward='always': free gathered parameters after each
    micro-batch's backward too; otherwise they stay gathered until the last one."""
    routing_stats: RoutingStats | None = None
    """The layout of the iteration's MoE routing statistics (None: a dense model)."""
    mtp_loss: MTPLoss | None = None
    """Multi-token prediction's loss terms and logged sums (None: the model has none)."""
    every_stage_reads_batches: bool = False
    """Every stage takes per-token inputs (reset position ids: RoPE in every block; document
    masking: every attention), so middle pipeline stages read the batches too."""

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    @property
    def reads_batches(self) -> bool:
        """The first stage needs tokens, the last labels; middle stages read no data unless every
        stage takes per-token inputs (the positions of the chunks it holds under cp, the documents
        under Megatron's reset options)."""
        return self.has_first_stage or self.has_last_stage or self.every_stage_reads_batches

    @property
    def compute_copy(self) -> ComputeCopy | None:
        """The first part's compute copy (the only one without a pipeline), or None."""
        return self.compute_copies[0] if self.compute_copies else None

    def forward_module(self) -> nn.Module:
        """What runs a micro-batch without a pipeline: the part, or its compute copy."""
        return self.compute_copies[0].refresh() if self.compute_copies else self.parts[0]

    def refresh_compute_copies(self) -> None:
        """Before a pipeline schedule runs: each stage's compute copy current with its masters
        (its stages run the copies; their gradients reach the masters from the stage's backward)."""
        for compute_copy in self.compute_copies:
            compute_copy.refresh()

    def after_backward(self, first: bool, last: bool) -> None:
        """After one micro-batch's backward (without a pipeline): the compute copy's gradients
        go to the fp32 masters."""
        if self.compute_copies:
            self.compute_copies[0].collect_grads(first, last)

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    @functools.cached_property
    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        # Walked once: the step asks several times per iteration, and the parameters are fixed
        # once the parts are built (parallelisation and the compute copy replace them before).
        seen, named = set(), []
        for part in self.parts:
            for name, p in part.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((name, p))
        return named

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named_parameters)

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def norm_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients count toward the global norm: the last stage's copy of a
        split tied weight is left out, so the shared weight counts once, as in one process."""
        _, tied_copy = tied_pair_on_rank(self.parts)
        return [p for p in self.parameters() if p is not tied_copy]

    @torch.no_grad()
    def reduce_pending_grads(self) -> None:
        """All-reduce, once, the gradients DTensor left as pending sums (Partial over tp), in one
        bucket (dtgpt/parallel/grad_bucket.py).

        Under sequence parallelism the replicated norm weights see a different sequence chunk
        on each tp rank; left Partial, every optimizer op that reads such a gradient (norm,
        clip, each Adam update) would all-reduce it again.
        """
        reduce_pending_grads_bucketed(self.parameters(), self.grad_reduce_dtype)
        for param in self.parameters():
            if param.grad is not None:
                align_grad_placement(param)

    def sync_tied_grads(self) -> None:
        if self.dims.pp_enabled:
            sync_tied_grads(self.parts, self.tied_group, self.grad_reduce_dtype)

    def check_tied_copies(self, iteration: int) -> None:
        """Raise if the pipeline's two copies of a tied embedding have drifted apart."""
        if self.dims.pp_enabled:
            check_tied_copies(self.parts, self.tied_group, iteration)
