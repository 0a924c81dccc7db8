"""Pipeline buffers on real ranks, for tests/test_pipeline_buffers.py: torchrun, 2 ranks (pp2).

    torchrun --nproc-per-node 2 tests/pipeline_buffers_worker.py OUT

For each schedule and micro-batch count below, builds the 4-layer model through the library
API, runs two forward_backward iterations with an SGD step between (the first infers the
stages' shapes) and an evaluation, and records on each rank:
- "after": the live tensors of the boundary activation's shape (micro_batch, seq, hidden) that
  are not parameters, after the second iteration (a census of every tensor Python holds);
- "peak": the most receive buffers the stages' receive infos held at any forward or backward
  of the second iteration (dtgpt.parallel.pipeline_buffers.held_buffers), the planner's
  pipeline-buffer count (dtgpt.plan.memory.pipeline_buffers).
- "after_eval": the same census after the evaluation;
- "numerics": the three losses (repr) and a digest of the rank's parameters.
The cases in WITH_TORCH_STAGE run again with torch's own PipelineStage, as "schedule/n/torch".
Rank r writes {"schedule/n": {...}} to OUT.r.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtgpt
from dtgpt.parallel import pipeline as pipeline_module
from dtgpt.parallel.pipeline_buffers import held_buffers, supported

MICRO, SEQ, HIDDEN = 1, 16, 24  # a shape no parameter has
CASES = [("1F1B", 1, 4), ("1F1B", 1, 32), ("Interleaved1F1B", 2, 4)]
# Run again with torch's own PipelineStage: what it kept, and the same numerics bit for bit.
WITH_TORCH_STAGE = [("1F1B", 1, 32), ("Interleaved1F1B", 2, 4)]


def config(schedule: str, stages_per_rank: int, n: int):
    return dtgpt.make_config(
        model=dict(num_layers=4, hidden_size=HIDDEN, num_attention_heads=2, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=64, num_workers=0),
        training=dict(micro_batch_size=MICRO, global_batch_size=MICRO * n, train_iters=3),
        parallel=dict(pipeline_model_parallel_size=2, pipeline_schedule=schedule, virtual_pipeline_stages_per_rank=stages_per_rank),
    )  # fmt: skip


def boundary_tensors(params: set[int]) -> int:
    gc.collect()
    storages = set()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        # (meta tensors hold no memory: torch 2.11's stage describes its receives by them)
        if tuple(obj.shape) == (MICRO, SEQ, HIDDEN) and id(obj) not in params and obj.device.type != "meta":
            storages.add(obj.untyped_storage().data_ptr())
    return len(storages)


def watch_peak(stages) -> list[int]:
    """Wrap each stage's forward and backward (this instance only) to note the buffers held."""
    peak = [0]

    def note():
        peak[0] = max(peak[0], sum(len(held_buffers(s)) for s in stages))

    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            method = getattr(stage, name)

            def wrapped(*args, _method=method, **kwargs):
                note()
                out = _method(*args, **kwargs)
                note()
                return out

            setattr(stage, name, wrapped)
    return peak


def run_case(runtime, schedule: str, per_rank: int, n: int, torch_stage: bool) -> dict:
    pipeline_module.supported = (lambda: False) if torch_stage else supported
    cfg = config(schedule, per_rank, n)
    model = dtgpt.build_model(cfg, runtime, vocab_size=64)
    batches = dtgpt.build_train_iterator(cfg, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [dtgpt.forward_backward(model, next(batches), n)]
    optimizer.step()
    optimizer.zero_grad()
    peak = watch_peak(model.schedules.stages)
    losses.append(dtgpt.forward_backward(model, next(batches), n))
    params = {id(p) for p in model.parameters()}
    result = {"after": boundary_tensors(params), "peak": peak[0], "stages": model.stage_ids}
    losses.append(dtgpt.forward_backward(model, next(batches), n, forward_only=True))
    result["after_eval"] = boundary_tensors(params)
    digest = hashlib.sha1()
    for p in model.parameters():
        digest.update(p.detach().to_local().numpy().tobytes() if isinstance(p, DTensor) else p.detach().numpy().tobytes())
    result["numerics"] = [repr(loss) for loss in losses] + [digest.hexdigest()]
    return result


def main() -> None:
    out_path = sys.argv[1]
    results = {}
    runtime = None
    for schedule, per_rank, n in CASES:
        runtime = runtime or dtgpt.init_distributed(config(schedule, per_rank, n))
        results[f"{schedule}/{n}"] = run_case(runtime, schedule, per_rank, n, torch_stage=False)
        if (schedule, per_rank, n) in WITH_TORCH_STAGE:
            results[f"{schedule}/{n}/torch"] = run_case(runtime, schedule, per_rank, n, torch_stage=True)
    with open(f"{out_path}.{dist.get_rank()}", "w") as f:
        json.dump(results, f)
    dtgpt.shutdown()


if __name__ == "__main__":
    main()
