"""Pipeline parallelism: cut the meta-device model into stages and build the schedule.

The model is built once, whole, on the meta device; each stage is a deep copy with the blocks
of other stages deleted (ModuleDict keys keep their global names, so checkpoints are
stage-free). The first stage keeps the embedding, the last the final norm and the head (with
multi-token prediction also the prediction modules and a copy of the word embedding, as Megatron's).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from dtgpt.attention_varlen import DocumentBounds, Documents
from dtgpt.config import V_SHAPED_SCHEDULES, Config, num_pipeline_stages
from dtgpt.config.pipeline_split import megatron_stage_layers
from dtgpt.model import GPT
from dtgpt.moe.stats import uncounted
from dtgpt.parallel.pipeline_buffers import BoundedPipelineStage, supported
from dtgpt.parallel.schedules import build_schedule


def stage_layer_counts(cfg: Config) -> list[int]:
    """Blocks per stage: explicit counts, Megatron's split keys' (dtgpt/config/pipeline_split.py),
    or an even split."""
    if cfg.parallel.pipeline_layers_per_stage:
        return list(cfg.parallel.pipeline_layers_per_stage)
    megatron = megatron_stage_layers(cfg)
    if megatron is not None:
        return megatron
    stages = num_pipeline_stages(cfg)
    return [cfg.model.num_layers // stages] * stages


def stage_ids_on_rank(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Which stages a pp rank holds: looped (r, r+pp, ...) or, for V schedules, (r, 2pp-1-r)."""
    if schedule in V_SHAPED_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def build_stage_model(whole: GPT, stage: int, counts: list[int]) -> GPT:
    """A copy of `whole` (on meta) holding only the parts of `stage`."""
    model = copy.deepcopy(whole)
    first = sum(counts[:stage])
    keep = {str(i) for i in range(first, first + counts[stage])}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    last = stage == len(counts) - 1
    if stage != 0 and last and model.mtp is not None:
        # Multi-token prediction embeds tokens on the last stage: its own copy of the word
        # embedding, kept equal to the first stage's as a tied head is (dtgpt.parallel.tied).
        model.embeds_input = False
    elif stage != 0:
        model.embedding = None
    if not last:
        model.norm = None
        model.output = None
        model.mtp = None
    elif model.tied and model.embedding is None:
        # The last stage holds its own copy of the tied weight; gradients are summed with the
        # first stage's every step (see dtgpt.parallel.tied), so the two stay equal.
        model.output.weight = torch.nn.Parameter(torch.empty_like(model.output.weight))
    return model


class _StageHooks:
    """What dtgpt adds to torch's stage (the bounded one or its own), three things (and, on torch
    2.11, no warm-up send to its own rank: _get_init_p2p_neighbors_ops):

    - after_backward: where the stage's module is a compute copy (dtgpt/parallel/compute_copy.py),
      after each of its backwards that gives parameter gradients (a full one, or a zero-bubble
      schedule's weight half), `after_backward(last)` moves them to the fp32 masters, as FSDP's
      post-backward would. torch's schedules pass `last_backward` to the stage's
      backward_maybe_with_nosync (checked on torch 2.13; the pipeline parity tests in bf16 fail
      if it stops being called).
    - micro_batch_documents: per micro-batch, where its documents start (DocumentBounds), set by
      ScheduleCache.run for one run. The schedule cuts tensor keywords along the batch itself,
      but would hand a non-tensor (the bounds are host numbers, ragged) whole to every micro-batch;
      so each forward pairs the document ids torch cut for micro-batch i with bounds i (the
      attention's varlen path, dtgpt/attention_varlen.py), and so does the schedule's stand-in
      forward that infers the stages' shapes (micro-batch 0's inputs; torch's private
      `_prepare_forward_infra`, checked on torch 2.11 and 2.13). tests/test_attention_varlen.py's pp runs count the
      kernel's calls on every stage.
    - inferring: True while torch's set-up (`_prepare_forward_infra`, `_prepare_backward_infra`)
      runs, in which torch may run the stage, and the loss, on stand-in inputs to infer shapes:
      torch 2.13 does, with gradients on, whenever a schedule first trains or switches between
      eval and training; torch 2.11 does once per stage, under no_grad. The MoE layers and the
      prediction modules' loss count nothing inside it, so the routing statistics are those of
      the real micro-batches on either torch (tests/test_parity.py's moe_pp2 case compares them
      with one process; checked on torch 2.11 and 2.13).
    """

    after_backward: Callable[[bool], None] | None = None
    micro_batch_documents: list[DocumentBounds] | None = None
    inferring = False

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if backward_type != "input" and self.after_backward is not None:
            self.after_backward(last_backward)
        return result

    def _with_documents(self, micro_batch: int, kwargs: dict | None) -> dict | None:
        if self.micro_batch_documents is None or not kwargs or "document_ids" not in kwargs:
            return kwargs
        return {**kwargs, "document_ids": Documents(kwargs["document_ids"], self.micro_batch_documents[micro_batch])}

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        return super().forward_one_chunk(fwd_chunk_id, args, self._with_documents(fwd_chunk_id, kwargs), save_forward_output)

    def _prepare_forward_infra(self, num_microbatches: int, args, kwargs=None, *more, **options):
        # The rest passes through as given: torch 2.13 adds has_backward, which 2.11 does not take.
        with self._stand_in():
            return super()._prepare_forward_infra(num_microbatches, args, self._with_documents(0, kwargs), *more, **options)

    def _prepare_backward_infra(self, *args, **kwargs):
        # torch 2.13 takes the loss function and the target here (and may call it), 2.11 only the count.
        with self._stand_in():
            return super()._prepare_backward_infra(*args, **kwargs)

    def _get_init_p2p_neighbors_ops(self) -> list:
        # torch 2.11 opens the link to each neighbouring stage with a send and a receive, a V
        # schedule's neighbour on this same rank included, and gloo cannot send to its own rank
        # ("Pair is not connected"): every V schedule failed on CPU. Same-rank stages hand their
        # tensors over without communication, so those ops are dropped (torch 2.13 warms up with
        # its own protocol and no longer calls this).
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    @contextmanager
    def _stand_in(self) -> Iterator[None]:
        # Nor does it draw from the random generators (its dropout): torch 2.13 forks them around
        # the inference, 2.11 does not, and a run resumed at iteration k infers again there.
        device = torch.device(self.device)
        self.inferring = True
        try:
            with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type), \
                    uncounted([self.submod] if hasattr(self, "submod") else []):
                yield
        finally:
            self.inferring = False


class _BoundedStage(_StageHooks, BoundedPipelineStage):
    pass


class _Stage(_StageHooks, PipelineStage):
    pass


def build_pipeline_stages(
    parts: list[GPT],
    stage_ids: list[int],
    num_stages: int,
    device: torch.device,
    pp_mesh: DeviceMesh,
    after_backward: list[Callable[[bool], None]] | None = None,
) -> list[PipelineStage]:
    """after_backward: per part, what moves a compute copy's gradients after each backward."""
    cls = _BoundedStage if supported() else _Stage
    stages = [
        cls(part, stage_index=sid, num_stages=num_stages, device=device, group=pp_mesh.get_group())
        for part, sid in zip(parts, stage_ids)
    ]
    for stage, hook in zip(stages, after_backward or ()):
        stage.after_backward = hook
    return stages


class ScheduleCache:
    """One schedule per micro-batch count (batch-size ramp-up changes it), built on first use.

    A schedule takes its loss function once, when built; the loss of a global batch differs per
    batch (its token count), so each run is handed its own loss, used for that run only.
    """

    def __init__(self, stages: list[PipelineStage], schedule_name: str):
        self.stages = stages
        self.schedule_name = schedule_name
        self._cache: dict[int, object] = {}
        self._loss: Callable | None = None

    def run(self, n_microbatches: int, loss: Callable, forward_only: bool, *args,
            document_bounds: list[DocumentBounds] | None = None, **kwargs) -> None:  # fmt: skip
        """One schedule step (or eval) over n_microbatches with `loss` as the loss function;
        document_bounds: per micro-batch, where the documents of its `document_ids` start."""
        schedule = self._get(n_microbatches)
        self._loss = loss
        for stage in self.stages:
            stage.micro_batch_documents = document_bounds
        try:
            (schedule.eval if forward_only else schedule.step)(*args, **kwargs)
        finally:
            self._loss = None
            for stage in self.stages:
                stage.micro_batch_documents = None

    def _loss_of_this_run(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mtp = getattr(self._loss, "mtp", None)
        if mtp is None or not any(stage.inferring for stage in self.stages):
            return self._loss(output, target)
        mtp.counting = False  # the prediction modules' loss of stand-in outputs (_StageHooks.inferring)
        try:
            return self._loss(output, target)
        finally:
            mtp.counting = True

    def _get(self, n_microbatches: int):
        if n_microbatches not in self._cache:
            self._cache[n_microbatches] = build_schedule(self.schedule_name, self.stages, n_microbatches, self._loss_of_this_run)
        return self._cache[n_microbatches]
