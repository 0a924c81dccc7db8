"""megatron-core's distributed optimizer on CPU: the oracle for Adam state in Megatron checkpoints.

Run through tests/megatron_gpt.py (one process, tp 1, so the vocabulary has dtgpt's 112 rows and
losses compare):

    adam DIR        wrap the GPTModel in megatron-core's DDP, build its DistributedOptimizer
                    (get_megatron_optimizer, AdamW), step once on mock samples 0-7, save model and
                    optimizer as Megatron-LM does (fully_reshardable: the model-space layout, or
                    with --sharding dp_reshardable its default per-bucket layout, and that
                    bucketed twin in model space under SHIFTED), then
                    step once more on samples 56-63, the batch a dtgpt run resuming at
                    consumed samples 56 trains on. DIR/adam.pt: {"saved": ..., "stepped": ...},
                    each {"weight" | "param" | "exp_avg" | "exp_avg_sq": {Megatron key: stacked}}
    sgd DIR         save the model's weights, then step the optimizer built with optimizer='sgd'
                    (fp32, not distributed) SGD_STEPS times on the mock samples from consumed 56 on;
                    DIR/sgd.pt: {"weight": {Megatron key: stacked}} after the last step; and the
                    same with megatron-core's Muon from the same weights (tests/megatron_muon.py),
                    DIR/muon.pt, its chain saved after the first step (DIR/muon_ckpt, torch_dist;
                    DIR/muon_per_rank); and DIR/from_dtgpt, where there is one, loaded into its
                    Muon chain (DIR/from_dtgpt/loaded_muon.pt)
    load-adam DIR   build the same, load DIR's checkpoint (model and optimizer),
                    DIR/loaded_adam.pt: the loaded state in the same layout; and DIR/per_rank's
                    per-rank files where there are, into its FP32Optimizer: DIR/loaded_per_rank_adam.pt

megatron-core 0.16.1 cannot save `fully_sharded_model_space` at all ("ShardedTensor.flattened_range
is not supported", on any device), so `fully_reshardable` is the model-space format it writes.
Patches on top of megatron_gpt.patch_megatron, none about numerics: factory calls with
device="cuda" make CPU tensors, `Tensor.cuda()` is the identity, `Tensor.type()` answers with the
CUDA type names its distributed optimizer checks for, torch.cuda.current_stream() is a stream that
waits for nothing (0.19's grad sync asks for it), and its model-space loader keeps torch
AdamW's per-parameter step (TE's and apex's Adam, its GPU optimizers, keep none).
"""

from __future__ import annotations

import argparse
import functools
import types
from pathlib import Path

import torch
import torch.distributed as dist

from tests.megatron_gpt import SEQ, VOCAB

ADAM = dict(lr=1e-3, decoupled_lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
"""The optimizer both sides run (dtgpt: the same [optimizer] keys, constant LR). decoupled_lr:
the word embedding (and the tied head) in a param group of its own at its own LR, as a Megatron
launch script with --decoupled-lr trains it; its checkpoint holds that third group."""
SGD_MOMENTUM, SGD_STEPS = 0.8, 3
"""The sgd command: --optimizer sgd --sgd-momentum 0.8 (not the default 0.9), three steps."""
BUCKET_SIZE = 40_000
"""Elements per grad bucket (Megatron-LM's --ddp-bucket-size) of the dp_reshardable twin: the
109k-parameter model spans three buckets (their unpadded lengths in adam.pt as "bucket_lengths"). (The model-space save keeps one bucket: megatron-core
0.16.1's fully_reshardable places a later bucket's state 64 elements off when an earlier bucket's
length is not a multiple of its padding, 128 at dp 1.)"""
SHIFTED = "fully_reshardable_buckets"
"""Where adam saves the dp_reshardable twin in model space too: its later buckets' state lands 64
elements off (megatron-core 0.16.1), so its master weights differ from its model weights."""
SEED = 1234  # dtgpt's training.seed default: the mock samples are dtgpt's
BATCH = 8


def patch_for_optimizer() -> None:
    if getattr(torch.Tensor.type, "patched_for_optimizer", False):  # once per process: the patches wrap
        return

    def on_cpu(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    tensor_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        return tensor_type(self, *args, **kwargs) if args or kwargs else tensor_type(self).replace("torch.", "torch.cuda.", 1)

    cuda_type.patched_for_optimizer = True
    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # megatron-core 0.19's grad sync asks for the current CUDA stream to wait on CUDA-graph
    # events (there are none): a stream that waits for nothing
    idle = types.SimpleNamespace(wait_event=lambda event: None, wait_stream=lambda stream: None)
    torch.cuda.current_stream = lambda *args, **kwargs: idle

    # torch's AdamW (used without TE or apex) keeps a per-parameter "step", which the model-space
    # loader does not hand over (load_state_dict already set it from the param groups): keep it.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        step = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]].get("step")
        return set_states(self, model_param, tensors if step is None else {**tensors, "step": step})

    DistributedOptimizer._set_main_param_and_optimizer_states = keep_step


def mock_batch(first: int) -> torch.Tensor:
    """dtgpt's mock training samples first .. first + 7 (data.vocab_size=100: 100 ids, eod 99).
    Any sample count within one epoch gives the same order, so first + BATCH samples suffice."""
    from dtgpt.data.mock import build_mock_dataset

    data = build_mock_dataset(0, first + BATCH, SEQ, VOCAB, VOCAB - 1, SEED, "train", None)
    return torch.stack([torch.as_tensor(data[i]) for i in range(first, first + BATCH)])


def build_optimizer(model, min_lr: float = 0.0, bucket_size: int | None = None, optimizer: str = "adam", distributed: bool | None = None):
    """megatron-core's DDP and optimizer around `model`: `optimizer` is its --optimizer, adam (the
    distributed optimizer unless `distributed` is False: then its FP32Optimizer) or sgd with
    SGD_MOMENTUM (its distributed optimizer refuses SGD, so the fp32 one, as Megatron-LM runs
    --optimizer sgd), with the ADAM keys besides."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    distributed = optimizer == "adam" if distributed is None else distributed
    # bucket_size: megatron-core cuts its grad buffer into buckets only with overlap_grad_reduce
    overlap = {"overlap_grad_reduce": True, "bucket_size": bucket_size} if bucket_size else {}
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, **overlap)
    # virtual pipeline chunks: a DDP (grad buffer) each, bucketed on the first alone (Megatron-LM's get_model)
    ddps = [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks_of(model))]
    # min_lr as Megatron-LM's --min-lr sets it (default 0; a bare OptimizerConfig has None): megatron-core
    # 0.19 matches a loaded checkpoint's param groups to its own by min_lr, among other keys
    config = OptimizerConfig(optimizer=optimizer, sgd_momentum=SGD_MOMENTUM, use_distributed_optimizer=distributed, min_lr=min_lr, **ADAM)
    return (ddps if isinstance(model, list) else ddps[0]), get_megatron_optimizer(config, ddps)


def step(ddp, optimizer, batch: torch.Tensor) -> tuple[float, float]:
    """One training iteration: the mean token loss of the batch, as Megatron-LM's loss_func.
    Returns (that loss, the gradient norm before clipping), as Megatron-LM logs them."""
    ids, labels = batch[:, :-1], batch[:, 1:]
    T = ids.shape[1]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)[None, None]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(ids, torch.arange(T).expand_as(ids), mask, labels=labels)
    mean = loss.sum() / loss.numel()
    mean.backward()
    ddp.finish_grad_sync()
    for group in optimizer.param_groups:  # what OptimizerParamScheduler sets every iteration (constant LR)
        group["lr"], group["weight_decay"] = group["max_lr"], ADAM["weight_decay"] * group["wd_mult"]
    assert sorted(g["max_lr"] for g in optimizer.param_groups) == [ADAM["lr"], ADAM["lr"], ADAM["decoupled_lr"]]
    stepped, grad_norm, _ = optimizer.step()
    assert stepped, "megatron-core skipped the step"
    return mean.item(), float(grad_norm)


def stacked_state(model, optimizer, slots: tuple[str, ...] = ("param", "exp_avg", "exp_avg_sq"), states_of=None) -> dict:
    """{"weight", *slots} -> {Megatron key: tensor, layers stacked}; the slots are the optimizer's
    (none for the weights alone), read by `states_of(optimizer, param)` (default optimizer_states);
    a parameter without a slot (Muon's matrices have no Adam moments) is left out of it."""
    states_of = states_of or optimizer_states
    out: dict[str, dict] = {slot: {} for slot in ("weight", *slots)}
    layers: dict[str, dict] = {}
    for sharded in model.sharded_state_dict().values():
        if not isinstance(getattr(sharded, "data", None), torch.nn.Parameter):
            continue  # _extra_state
        states = states_of(optimizer, sharded.data) if slots else {}
        values = {"weight": sharded.data, **{k: states[k] for k in slots if k in states}}
        for slot, value in values.items():
            value = value.detach().reshape(sharded.data.shape).clone()
            if sharded.prepend_axis_num:
                layers.setdefault(slot, {}).setdefault(sharded.key, {})[sharded.global_offset[0]] = value
            else:
                out[slot][sharded.key] = value
    for slot, keys in layers.items():
        for key, by_layer in keys.items():
            out[slot][key] = torch.stack([by_layer[i] for i in sorted(by_layer)])
    return out


def optimizer_states(optimizer, param) -> dict:
    """{"param", "exp_avg", "exp_avg_sq"} of `param`: the distributed optimizer's master copy and
    moments, or the FP32Optimizer's (the fp32 parameter is its own master)."""
    inner = optimizer.chained_optimizers[0]
    if hasattr(inner, "_get_main_param_and_optimizer_states"):
        return inner._get_main_param_and_optimizer_states(param)
    return {"param": param, **{k: inner.optimizer.state[param][k] for k in ("exp_avg", "exp_avg_sq")}}


def save_per_rank(model, optimizer, root: Path, trainer_state: dict, **args) -> None:
    """Megatron-LM's legacy save (--ckpt-format torch, megatron/training/checkpointing.py, which the
    pip package lacks), as its generate_state_dict builds it on each model-parallel rank (dp 1), in
    mp_rank_TT (pp 1) or mp_rank_TT_PPP: model_optim_rng.pt holds the rank's model,
    `optimizer.state_dict()` (the FP32Optimizer's: torch's AdamW state by parameter index; the
    distributed optimizer's: its param groups and step alone), the scheduler and args (`args`:
    what differs from trainer_state's); with the distributed optimizer, save_parameter_state
    writes the rank's distrib_optim.pt beside it (its grad buffer, buckets coalesced)."""
    from megatron.core import parallel_state

    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}" if parallel_state.get_pipeline_model_parallel_world_size() == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    rank_dir = root / f"iter_{trainer_state['iteration']:07d}" / name
    rank_dir.mkdir(parents=True, exist_ok=True)
    saved_args = argparse.Namespace(**{**vars(trainer_state["args"]), **args})
    state = {**trainer_state, "args": saved_args, **model_states(model, lambda chunk: chunk.state_dict_for_save_checkpoint()), "optimizer": optimizer.state_dict()}
    torch.save(state, rank_dir / "model_optim_rng.pt")
    if args.get("use_distributed_optimizer"):
        optimizer.chained_optimizers[0].save_parameter_state(str(rank_dir / "distrib_optim.pt"))
    (root / "latest_checkpointed_iteration.txt").write_text(str(trainer_state["iteration"]))


def run_adam(command: str, model, root: Path, trainer_state: dict, shardings: tuple[str, ...] = ("fully_reshardable",), twin=None,
             per_rank: bool = False) -> None:
    """`shardings`: the distributed optimizer's distrib_optim_sharding_type(s), fully_reshardable
    (model space) or dp_reshardable (per-bucket flat buffers, Megatron-LM's default). adam saves
    the first under root; each other from a `twin()` model (the same weights) whose grad buffer is cut into buckets of
    BUCKET_SIZE (the same step on the same batch), under root/<type>, its state in adam.pt as
    "saved_<type>". load-adam loads the first. `per_rank`: the same states also in Megatron-LM's
    per-rank format (save_per_rank): the distributed optimizer's under root/distrib_optim (one
    bucket) and, from the twin, root/distrib_optim_buckets (BUCKET_SIZE buckets); and a twin's
    FP32Optimizer (--use-distributed-optimizer off) under root/per_rank, its state in adam.pt as
    "saved_per_rank" and, after the next step, "stepped_per_rank"."""
    from megatron.core import dist_checkpointing, parallel_state

    patch_for_optimizer()
    ddp, optimizer = build_optimizer(model, optimizer="sgd" if command == "sgd" else "adam")
    metadata = {"distrib_optim_sharding_type": shardings[0]}
    if command == "sgd":
        directory = root / f"iter_{trainer_state['iteration']:07d}"
        directory.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), **trainer_state}, str(directory))
        (root / "latest_checkpointed_iteration.txt").write_text(str(trainer_state["iteration"]))
        consumed = trainer_state["args"].consumed_train_samples
        for k in range(SGD_STEPS):  # the batches a dtgpt run resuming at these consumed samples trains on
            step(ddp, optimizer, mock_batch(consumed + k * BATCH))
        torch.save(stacked_state(model, optimizer, slots=()), root / "sgd.pt")
        from tests.megatron_muon import FROM_DTGPT, load_muon, step_muon

        step_muon(twin(), root, trainer_state)  # megatron-core's Muon from the same weights, on the same batches
        if (root / FROM_DTGPT).is_dir():  # and dtgpt's Muon state written as Megatron's, loaded into its chain
            load_muon(twin(), root / FROM_DTGPT)
    elif command == "adam":
        # at dp > 1 each rank holds a share of each parameter's state: only the checkpoints are written
        whole = parallel_state.get_data_parallel_world_size() == 1
        step(ddp, optimizer, mock_batch(0))
        save(model, optimizer, root, shardings[0], trainer_state)
        states = {"saved": stacked_state(model, optimizer)} if whole else {}
        if per_rank:
            save_per_rank(model, optimizer, root / "distrib_optim", trainer_state, use_distributed_optimizer=True)
            states.update(fp32_optimizer_states(twin(), root / "per_rank", trainer_state))
        for sharding in shardings[1:]:
            other = twin()
            other_ddp, other_optimizer = build_optimizer(other, bucket_size=BUCKET_SIZE)
            step(other_ddp, other_optimizer, mock_batch(0))
            save(other, other_optimizer, root / sharding, sharding, trainer_state)
            if per_rank:
                save_per_rank(other, other_optimizer, root / "distrib_optim_buckets", trainer_state, use_distributed_optimizer=True,
                              overlap_grad_reduce=True, ddp_bucket_size=BUCKET_SIZE, data_parallel_size=1)  # fmt: skip
            if sharding == "dp_reshardable":  # and model space: megatron-core 0.16.1 shifts a later bucket's state
                save(other, other_optimizer, root / SHIFTED, "fully_reshardable", trainer_state)
            if whole:
                states[f"saved_{sharding}"] = stacked_state(other, other_optimizer)
                states["bucket_lengths"] = [bucket.numel_unpadded for bucket in other_ddp.buffers[0].buckets]
        if whole:
            step(ddp, optimizer, mock_batch(trainer_state["args"].consumed_train_samples))
            torch.save({**states, "stepped": stacked_state(model, optimizer)}, root / "adam.pt")
    else:
        directory = root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}"
        # Without TE or apex its torch-AdamW path reads the step from existing state: create
        # some, as its own fsdp_dtensor load does (the load then overwrites all of it).
        optimizer.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
        sharded = model.sharded_state_dict()
        request = {"model": sharded, "optimizer": optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)}
        loaded = dist_checkpointing.load(request, str(directory))
        model.load_state_dict(loaded["model"], strict=False)
        optimizer.load_state_dict(loaded["optimizer"])
        torch.save(stacked_state(model, optimizer), root / "loaded_adam.pt")
        if (root / "per_rank").is_dir():
            torch.save(load_per_rank(twin(), root / "per_rank"), root / "loaded_per_rank_adam.pt")
    dist.barrier()


def load_per_rank(model, root: Path) -> dict:
    """Megatron-LM's legacy load of root's per-rank file at tp 1, pp 1 into `model` and
    megatron-core's FP32Optimizer (load_checkpoint: the model strictly, then
    optimizer.load_state_dict), and the state they then hold."""
    from megatron.core.optimizer import optimizer as megatron_optimizer

    # megatron-core 0.16.1 tells a loaded param group by (wd_mult, lr_mult, is_expert_parallel,
    # is_decoupled_lr), which --decoupled-lr's group shares with the default one (it differs in
    # max_lr alone), so it gives both the same group and refuses its own legacy save; the current
    # Megatron-LM source adds the override keys (max_lr, min_lr) to the identifier, as here
    keys = megatron_optimizer.param_group_identifier_keys
    megatron_optimizer.param_group_identifier_keys = (*keys, *(k for k in ("max_lr", "min_lr") if k not in keys))
    ddp, optimizer = build_optimizer(model, distributed=False)
    directory = root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}" / "mp_rank_00"
    saved = torch.load(directory / "model_optim_rng.pt", weights_only=False)
    model.load_state_dict(saved["model"], strict=True)
    optimizer.load_state_dict(saved["optimizer"])
    return stacked_state(model, optimizer)


def fp32_optimizer_states(model, root: Path, trainer_state: dict) -> dict:
    """`model` with megatron-core's FP32Optimizer (not distributed) stepped on the first batch,
    saved per rank under root, then stepped on the next: its state then and after."""
    ddp, optimizer = build_optimizer(model, distributed=False)
    step(ddp, optimizer, mock_batch(0))
    save_per_rank(model, optimizer, root, trainer_state, use_distributed_optimizer=False)
    saved = stacked_state(model, optimizer)
    step(ddp, optimizer, mock_batch(trainer_state["args"].consumed_train_samples))
    return {"saved_per_rank": saved, "stepped_per_rank": stacked_state(model, optimizer)}


PARALLEL_BUCKET_SIZE = 8_000
"""Elements per grad bucket of adam-parallel's dp_reshardable twin: several buckets on the first
pipeline stage (megatron-core keeps one on the others, besides a tied head's own)."""


def synthetic_step(model, ddp, optimizer) -> None:
    """One optimizer step on gradients made from the weights, sin(7 w): equal on every copy of a
    parameter (tp replicas, a tied head's copy on the last stage), with no pipeline schedule."""
    for one in ddp if isinstance(ddp, list) else [ddp]:
        one.zero_grad_buffer()
    optimizer.zero_grad()
    for param in (p for chunk in chunks_of(model) for p in chunk.parameters()):
        param.main_grad.copy_(torch.sin(7 * param.detach().float()))
    for group in optimizer.param_groups:  # as step() sets them
        group["lr"], group["weight_decay"] = group["max_lr"], ADAM["weight_decay"] * group["wd_mult"]
    assert optimizer.step()[0], "megatron-core skipped the step"


def run_adam_parallel(model, root: Path, trainer_state: dict, twin) -> None:
    """At tp 2 x pp 2 (dp 1): one synthetic step of the distributed optimizer, saved in model space
    (fully_reshardable, one bucket: megatron-core gathers each parameter's tp shards) under root
    and per rank (each rank's distrib_optim.pt) under root/distrib_optim, and the same step of a
    `twin()` cut into PARALLEL_BUCKET_SIZE buckets saved dp_reshardable under root/dp_reshardable
    and per rank under root/distrib_optim_buckets: the same state in four layouts, and each rank's
    bucket lengths in root/bucket_lengths.pt, {"mp_rank_TT_PPP": [[unpadded length per bucket] per grad buffer]}
    (`model`: a list of virtual pipeline chunks, a grad buffer each)
    (patch_for_optimizer already run)."""
    from megatron.core import parallel_state

    ddp, optimizer = build_optimizer(model)
    synthetic_step(model, ddp, optimizer)
    save(model, optimizer, root, "fully_reshardable", trainer_state)
    save_per_rank(model, optimizer, root / "distrib_optim", trainer_state, use_distributed_optimizer=True)
    other = twin()
    other_ddp, other_optimizer = build_optimizer(other, bucket_size=PARALLEL_BUCKET_SIZE)
    synthetic_step(other, other_ddp, other_optimizer)
    save(other, other_optimizer, root / "dp_reshardable", "dp_reshardable", trainer_state)
    save_per_rank(other, other_optimizer, root / "distrib_optim_buckets", trainer_state, use_distributed_optimizer=True,
                  overlap_grad_reduce=True, ddp_bucket_size=PARALLEL_BUCKET_SIZE, data_parallel_size=1)  # fmt: skip
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    lengths = [None] * dist.get_world_size()
    buffers = [one.buffers[0] for one in other_ddp] if isinstance(other_ddp, list) else other_ddp.buffers
    dist.all_gather_object(lengths, (f"mp_rank_{tp:02d}_{pp:03d}", [[b.numel_unpadded for b in buffer.buckets] for buffer in buffers]))
    if dist.get_rank() == 0:
        torch.save(dict(lengths), root / "bucket_lengths.pt")
    dist.barrier()


def chunks_of(model) -> list:
    """A model's chunks: the virtual pipeline stages of a list, else the model alone."""
    return model if isinstance(model, list) else [model]


def model_states(model, state) -> dict:
    """Megatron-LM's model entries of a checkpoint: "model", or one "model<i>" per virtual chunk."""
    if not isinstance(model, list):
        return {"model": state(model)}
    return {f"model{i}": state(chunk) for i, chunk in enumerate(model)}


def save(model, optimizer, root: Path, sharding: str, trainer_state: dict) -> None:
    """Model and optimizer as Megatron-LM saves them, the optimizer in `sharding`, and the pointer."""
    from megatron.core import dist_checkpointing

    directory = root / f"iter_{trainer_state['iteration']:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    models = model_states(model, lambda chunk: chunk.sharded_state_dict())
    optimizer_state = optimizer.sharded_state_dict(models, metadata={"distrib_optim_sharding_type": sharding})
    dist_checkpointing.save({**models, "optimizer": optimizer_state, **trainer_state}, str(directory))
    (root / "latest_checkpointed_iteration.txt").write_text(str(trainer_state["iteration"]))
