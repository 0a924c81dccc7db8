"""megatron-core's distributed optimizer on the MLA + MoE + MTP model: the oracle for a Megatron
checkpoint of that model carrying Adam state, and for Megatron's next step from it.

Called at the end of tests/megatron_mla_gpt.py's launch (2 gloo ranks): tp 1 with the experts over
ep 2, so the dense parameters are data parallel over both ranks (the distributed optimizer shards
their state over dp 2) and the experts are not (megatron-core gives them an optimizer of their own,
chained after the dense one), as a Megatron-LM MoE run keeps them. The vocabulary has dtgpt's 128
rows (make_vocab_size_divisible_by 32). It:
- steps once (the iteration that ends at the checkpoint), on mock samples 0-7, each dp rank its 4;
- saves model and optimizer as Megatron-LM does with --dist-ckpt-optim-fully-reshardable (its
  content metadata, chained_optim_avoid_prefix included) under ROOT/megatron_adam, iteration 7,
  with its own OptimizerParamScheduler's state at 48 samples; and the same without
  chained_optim_avoid_prefix (each optimizer's tensors under chained_<i>., as Megatron-LM saved
  them before July 2025) under ROOT/megatron_adam_chained;
- steps once more, as Megatron-LM's train_step does (forward-backward, finalize_model_grads with
  its expert-bias update, optimizer step, scheduler step), on the global batch a dtgpt run resumed
  at 56 consumed samples trains on first, and saves that under ROOT/megatron_adam_stepped
  (iteration 8); ROOT/adam_step.pt: that step's LM loss, MTP loss and gradient norm;
- the first step again with the grad buffers cut into buckets, saved in Megatron-LM's default
  layout (dp_reshardable) under ROOT/megatron_adam_dp_reshardable (save_bucketed); and at tp 2
  (under the local spec and as Transformer Engine's holds multi-latent attention) and at pp 2
  one synthetic step each, saved in both layouts (save_tp2_pp2).

Only the second step is compared, so the first may take any LR: the scheduler stands at 40 samples.
CPU patches: tests/megatron_adam.py's, and the experts drawn by their global index (every rank
draws the same (E, ...) tensors and keeps its own experts), so no two experts are equal.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from tests.megatron_adam import ADAM, build_optimizer, mock_batch, patch_for_optimizer
from tests.megatron_gpt import CONSUMED, ITERATION, LR_SAMPLES
from tests.megatron_mla_gpt import EXPERTS, MTP, build, inputs_of

DIVISIBLE_BY, ROWS = 32, 128  # make_vocab_size_divisible_by on both sides: 100 ids padded to 128 rows at tp 1
SCHEDULE = dict(min_lr=1e-4, lr_decay_style="cosine", lr_warmup_iters=2, lr_decay_iters=10)
"""The LR schedule both sides run (dtgpt: the same [optimizer] keys; 8 samples an iteration), so
Megatron's next step takes its LR from the checkpoint's scheduler at 48 samples: cosine decay."""
GLOBAL_BATCH = 8
BUCKET_SIZE = 30_000
"""Elements per grad bucket (--ddp-bucket-size) of the dp_reshardable save: several buckets in the
dense buffer (115k elements) and in each rank's expert buffer (3 blocks x 4 experts x 6144)."""


def draw_experts(model, seed: int) -> None:
    """Each expert's weights by its global index: one (E, ...) draw per weight, this rank's slice."""
    from megatron.core import parallel_state

    ep, rank = parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
    draw = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if type(module).__name__ != "SequentialMLP":
            continue
        local = EXPERTS // ep
        for name in ("linear_fc1", "linear_fc2"):
            weight = getattr(module.local_experts[0], name).weight
            full = torch.randn((EXPERTS, *weight.shape), generator=draw) * 0.02
            for i, expert in enumerate(module.local_experts):
                getattr(expert, name).weight.data.copy_(full[rank * local + i])


def build_optimizer_and_scheduler(model, bucket_size: int | None = None):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp, optimizer = build_optimizer(model, min_lr=SCHEDULE["min_lr"], bucket_size=bucket_size)
    samples = {k: SCHEDULE[f"lr_{k}_iters"] * GLOBAL_BATCH for k in ("warmup", "decay")}
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=ADAM["lr"], min_lr=SCHEDULE["min_lr"],
                                        lr_warmup_steps=samples["warmup"], lr_decay_steps=samples["decay"],
                                        lr_decay_style=SCHEDULE["lr_decay_style"], start_wd=ADAM["weight_decay"],
                                        end_wd=ADAM["weight_decay"], wd_incr_steps=samples["decay"], wd_incr_style="constant")  # fmt: skip
    return ddp, optimizer, scheduler


def train_step(ddp, optimizer, scheduler, batch: torch.Tensor) -> torch.Tensor:
    """Megatron-LM's train_step on this dp rank's share of a global batch:
    [LM loss, MTP loss, gradient norm], the losses averaged over dp."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = batch[rank * len(batch) // dp:(rank + 1) * len(batch) // dp]
    ids, labels = share[:, :-1], share[:, 1:]
    tracker = MTPLossLoggingHelper.tracker
    tracker.clear()
    tracker["values"] = torch.zeros(MTP["mtp_num_layers"])
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp.train()
    loss = ddp(*inputs_of(ids), labels=labels)
    (loss.sum() / loss.numel()).backward()  # the MTP loss's gradient joins through its autoscaler
    finalize_model_grads([ddp])  # dp reduction, and the expert bias moved towards the mean load
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful, "megatron-core skipped the step"
    scheduler.step(increment=GLOBAL_BATCH)
    losses = torch.stack([loss.detach().float().mean(), tracker["values"][0]]) / dp
    tracker.clear()
    dist.all_reduce(losses)
    return torch.cat([losses, torch.tensor([float(grad_norm)])])


def save(ddp, optimizer, scheduler, directory: Path, state: dict, avoid_prefix: bool = True, sharding: str = "fully_reshardable") -> None:
    from megatron.core import dist_checkpointing, parallel_state

    # Megatron-LM's content metadata (checkpointing._build_sharded_state_dict_metadata) with
    # --dist-ckpt-optim-fully-reshardable: model-space optimizer tensors, chained ones unprefixed
    # (avoid_prefix False: chained_<i>.optimizer.state.*, as before Megatron-LM set it); without
    # that flag (sharding dp_reshardable, its default) the flat buckets of each grad buffer
    metadata = {"distrib_optim_sharding_type": sharding, "distrib_optim_fully_reshardable_mem_efficient": False,
                "singleton_local_shards": False, "chained_optim_avoid_prefix": avoid_prefix,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}  # fmt: skip
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model = ddp.module.sharded_state_dict(metadata=metadata)
    content = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
    dist_checkpointing.save({**state, "model": model, "optimizer": optimizer.sharded_state_dict(model, metadata=metadata),
                             "opt_param_scheduler": scheduler.state_dict(), "content_metadata": content}, str(directory))  # fmt: skip
    if dist.get_rank() == 0:
        (directory.parent / "latest_checkpointed_iteration.txt").write_text(str(state["iteration"]))


@contextmanager
def unclipped(optimizer):
    """megatron-core's optimizer steps without gradient clipping, then clips again."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    for one in optimizers:
        one.config.clip_grad = 0.0
    yield
    for one in optimizers:
        one.config.clip_grad = ADAM["clip_grad"]


def first_step(ddp, optimizer, scheduler) -> None:
    """The iteration that ends at the checkpoint, unclipped: the gradient norm's sum order
    depends on the bucket cuts, so a clipped step of a bucketed buffer would differ from the
    one-bucket buffer's in the last bit; unclipped, the two states are equal bit for bit."""
    scheduler.num_steps = LR_SAMPLES - GLOBAL_BATCH
    scheduler.step(increment=0)
    with unclipped(optimizer):
        train_step(ddp, optimizer, scheduler, mock_batch(0))


def save_bucketed(directory: Path, state: dict) -> None:
    """The same first step of the same model, its grad buffers cut into BUCKET_SIZE buckets, saved
    in Megatron-LM's default layout (dp_reshardable) under `directory`: the one-bucket
    optimizer's state bit for bit (first_step)."""
    model = build(1, 1234, te_names=False, vocab=ROWS, ep=dist.get_world_size())
    draw_experts(model, 5)
    ddp, optimizer, scheduler = build_optimizer_and_scheduler(model, bucket_size=BUCKET_SIZE)
    first_step(ddp, optimizer, scheduler)
    assert len(ddp.buffers[0].buckets) > 1 and len(ddp.expert_parallel_buffers[0].buckets) > 1
    save(ddp, optimizer, scheduler, directory, state, sharding="dp_reshardable")


SYNTHETIC = (("megatron_adam_tp2", 2, 1, False), ("megatron_adam_tp2_te", 2, 1, True), ("megatron_adam_pp2", 1, 2, False))
"""(directory, tp, pp, multi-latent attention held as Transformer Engine's spec holds it) of
save_tp2_pp2's synthetic steps: the tp 2 two from equal weights (tests/megatron_mla_te.py)."""


def draw_expert_shards(model) -> None:
    """Each MoE block's, expert's, expert tp shard's and pipeline stage's own weights."""
    from megatron.core import parallel_state

    shard, stage = parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    for block, module in enumerate(m for m in model.modules() if type(m).__name__ == "SequentialMLP"):
        for expert, mlp in enumerate(module.local_experts):
            draw = torch.Generator().manual_seed(100 + expert + 10 * block + 1000 * shard + 10_000 * stage)
            for param in mlp.parameters():
                param.data.copy_(0.02 * torch.randn(param.shape, generator=draw))


def save_tp2_pp2(root: Path, state: dict) -> None:
    """At tp 2 (dp 1, ep 1: the experts in the dense buffer, split over expert tp 2 as the dense
    MLP's; each expert tp shard drawn apart), the same weights under the local spec and as
    Transformer Engine's spec holds multi-latent attention (its down-projections whole on each tp
    rank, the compressed vectors' norms fused into the up-projections), and at pp 2 (the dense
    layer first, Megatron's decoder_first_pipeline_num_layers=1; the MTP block and its own copy of
    the word embedding on the last stage): one synthetic step (tests/megatron_adam.py) each,
    unclipped (the gradient norm's sum order differs between the specs; unclipped, their states
    are equal bit for bit), saved in model space under ROOT/<SYNTHETIC's directory> and
    dp_reshardable under ROOT/<directory>/dp_reshardable: the same state in both layouts."""
    from megatron.core import parallel_state

    from tests.megatron_adam import synthetic_step
    from tests.megatron_mla_te import to_transformer_engine_placement

    for name, tp, pp, transformer_engine in SYNTHETIC:
        parallel_state.initialize_model_parallel(tp, pp)
        model = build(tp, 1234, te_names=False, pp=pp, vocab=ROWS)
        draw_expert_shards(model)
        if transformer_engine:
            to_transformer_engine_placement(model)
        ddp, optimizer, scheduler = build_optimizer_and_scheduler(model)
        with unclipped(optimizer):
            synthetic_step(model, ddp, optimizer)
        args = dict(vars(state["args"]), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, decoder_first_pipeline_num_layers=1,
                    padded_vocab_size=ROWS, make_vocab_size_divisible_by=DIVISIBLE_BY, use_distributed_optimizer=True)  # fmt: skip
        for sharding, directory in (("fully_reshardable", root / name), ("dp_reshardable", root / name / "dp_reshardable")):
            save(ddp, optimizer, scheduler, directory / f"iter_{ITERATION:07d}", {**state, "args": argparse.Namespace(**args)}, sharding=sharding)
        parallel_state.destroy_model_parallel()


def adam_oracle(root: Path, state: dict) -> None:
    """The module doc's two steps and two saves, on the launch's ranks (tp 1, ep = world size)."""
    from megatron.core import parallel_state

    ep = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    patch_for_optimizer()
    model = build(1, 1234, te_names=False, vocab=ROWS, ep=ep)
    draw_experts(model, 5)
    ddp, optimizer, scheduler = build_optimizer_and_scheduler(model)
    first_step(ddp, optimizer, scheduler)
    args = dict(vars(state["args"]), expert_model_parallel_size=ep, tensor_model_parallel_size=1, padded_vocab_size=ROWS,
                make_vocab_size_divisible_by=DIVISIBLE_BY, use_distributed_optimizer=True)  # fmt: skip
    saved = {**state, "args": argparse.Namespace(**args)}
    for name, avoid_prefix in (("megatron_adam", True), ("megatron_adam_chained", False)):
        save(ddp, optimizer, scheduler, root / name / f"iter_{ITERATION:07d}", saved, avoid_prefix)
    save_bucketed(root / "megatron_adam_dp_reshardable" / f"iter_{ITERATION:07d}", saved)
    step = train_step(ddp, optimizer, scheduler, mock_batch(CONSUMED))
    args["consumed_train_samples"] = CONSUMED + GLOBAL_BATCH
    stepped = {**state, "iteration": ITERATION + 1, "args": argparse.Namespace(**args)}
    save(ddp, optimizer, scheduler, root / "megatron_adam_stepped" / f"iter_{ITERATION + 1:07d}", stepped)
    if dist.get_rank() == 0:
        torch.save(step, root / "adam_step.pt")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    save_tp2_pp2(root, state)
