"""megatron-core 0.16.1's Muon builder (get_megatron_muon_optimizer) on its GPTModel, inside the
launches of tests/megatron_gpt.py: which parameters it gives Muon (the `family` launch, tp 2; read
by tests/test_megatron_family.py) and three of its steps (the `sgd` launch; read by tests/test_sgd.py);
and which it gives Muon on the MLA + MoE model of tests/megatron_mla_gpt.py's launch (tp 2; read by
tests/test_megatron_mla_muon.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from tests.muon_oracle import load as load_muon_module

MUON_ARCHS = (("gpt", False), ("rope", False), ("llama", True), ("options", False))
"""(architecture of tests/megatron_gpt.py, untied head): learned positions, tied and untied heads, grouped-query
attention and SwiGLU, qk-layernorm and a QKV bias."""


MUON = dict(muon_momentum=0.9, muon_use_nesterov=True, muon_fp32_matmul_prec="high")
"""The Muon keys of the three steps beside tests/megatron_adam.py's ADAM ones: Megatron-LM's
--muon-momentum default (OptimizerConfig's own is 0.95; Megatron-LM passes its flag's 0.9),
Nesterov, and the Newton-Schulz iteration in fp32 (the two sides' gradients differ by rounding,
which bf16 would round up)."""


def available() -> bool:
    from megatron.core.package_info import __version__

    from tests.muon_oracle import EMERGING_OPTIMIZERS

    return EMERGING_OPTIMIZERS.is_dir() and __version__ == "0.16.1"  # the builder's signature is 0.16's


MUON_SAVED = "muon_ckpt"
"""Where step_muon saves megatron-core's Muon after its first step, as Megatron-LM's torch_dist does."""
MUON_PER_RANK = "muon_per_rank"
"""Where step_muon saves the same in Megatron-LM's per-rank format (--ckpt-format torch)."""
MUON_SLOTS = ("momentum_buffer", "exp_avg", "exp_avg_sq")
"""The state of megatron-core's Muon: its matrices' momentum, Adam's moments of the rest."""


def step_muon(model, root: Path, trainer_state: dict) -> None:
    """SGD_STEPS steps of the Muon that get_megatron_muon_optimizer builds (fp32, the ADAM and
    MUON keys, the word embedding at its decoupled LR) on the mock samples from the consumed ones
    of `trainer_state` on: what the sgd command does with SGD. After the first step it saves
    model and optimizer as Megatron-LM does (save_muon) under root/MUON_SAVED. root/muon.pt:
    {"weight": {Megatron key: stacked}} after the last step, "saved": the weights and MUON_SLOTS
    as saved, "losses" and "grad_norms": each step's loss and gradient norm."""
    if not available():
        return
    muon = load_muon_module()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests.megatron_adam import ADAM, BATCH, SGD_STEPS, mock_batch, save_per_rank, stacked_state, step

    consumed = trainer_state["args"].consumed_train_samples
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = muon.get_megatron_muon_optimizer(OptimizerConfig(optimizer="muon", min_lr=0.0, **ADAM, **MUON), [ddp])
    losses, grad_norms = [], []
    for k in range(SGD_STEPS):
        loss, grad_norm = step(ddp, optimizer, mock_batch(consumed + k * BATCH))
        losses.append(loss)
        grad_norms.append(grad_norm)
        if k == 0:
            save_muon(model, optimizer, root / MUON_SAVED, trainer_state, BATCH)
            save_per_rank(model, optimizer, root / MUON_PER_RANK, one_step_on(trainer_state, BATCH))  # its optimizer entry: the chain's list
            saved = stacked_state(model, optimizer, MUON_SLOTS, chained_states)
    torch.save({**stacked_state(model, optimizer, slots=()), "saved": saved, "losses": losses, "grad_norms": grad_norms}, root / "muon.pt")


FROM_DTGPT = "from_dtgpt"
"""Where write_dtgpt_muon puts dtgpt's Muon checkpoint written as Megatron's (to-megatron), for
the sgd launch to load into megatron-core's Muon chain (load_muon)."""


def write_dtgpt_muon(root: Path) -> Path:
    """root/dtgpt: a dtgpt Muon run of the sgd launch's model after one step on mock samples 0-7
    (tests/test_sgd.py's flags), saved; root/FROM_DTGPT: it written by to_megatron. Returns the
    dtgpt checkpoint's iteration directory. Runs in the test process, before the launch."""
    from dtgpt.api import build_model, build_train_state, init_distributed, shutdown, train_step
    from dtgpt.checkpoint import Checkpointer, layout, megatron
    from dtgpt.config import load_config
    from dtgpt.faults.injection import build_faults
    from tests.megatron_adam import mock_batch
    from tests.megatron_gpt import VOCAB
    from tests.megatron_checkpoints import ADAM_RUN
    from tests.test_sgd import MUON_FLAGS

    cfg = load_config(None, [*ADAM_RUN, *MUON_FLAGS, f"--checkpoint.save={root / 'dtgpt'}"])
    runtime = init_distributed(cfg)
    state = build_train_state(cfg, build_model(cfg, runtime, VOCAB))
    train_step(cfg, state, mock_batch(0))
    Checkpointer(state, cfg, runtime, build_faults(cfg.faults, runtime.rank, runtime.restart_count)).save(1)
    shutdown()
    saved = layout.iteration_dir(root / "dtgpt", 1)
    megatron.to_megatron(saved, cfg, root / FROM_DTGPT)
    return saved


def load_muon(model, root: Path) -> None:
    """root's Megatron checkpoint loaded into megatron-core's Muon chain as Megatron-LM's torch_dist
    load does (model, then optimizer.load_state_dict); root/loaded_muon.pt: the weights and
    MUON_SLOTS it then holds, and "step": Adam's."""
    if not available():
        return
    muon = load_muon_module()
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests.megatron_adam import ADAM, stacked_state

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = muon.get_megatron_muon_optimizer(OptimizerConfig(optimizer="muon", min_lr=0.0, **ADAM, **MUON), [ddp])
    directory = root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    sharded = model.sharded_state_dict()
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    loaded = dist_checkpointing.load({"model": sharded, "optimizer": optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)},
                                     str(directory))  # fmt: skip
    model.load_state_dict(loaded["model"], strict=False)
    optimizer.load_state_dict(loaded["optimizer"])
    steps = {float(s["step"]) for inner in optimizer.chained_optimizers for s in inner.optimizer.state.values() if "step" in s}
    torch.save({**stacked_state(model, optimizer, MUON_SLOTS, chained_states), "step": steps}, root / "loaded_muon.pt")


def chained_states(optimizer, param) -> dict:
    """`param`'s state in megatron-core's Muon chain (FP32Optimizers: the parameter is its own master)."""
    for inner in optimizer.chained_optimizers:
        if param in inner.optimizer.state:
            return dict(inner.optimizer.state[param])
    return {}


def one_step_on(trainer_state: dict, samples: int) -> dict:
    """`trainer_state` one iteration and `samples` samples later."""
    import argparse

    args = argparse.Namespace(**{**vars(trainer_state["args"]), "consumed_train_samples": trainer_state["args"].consumed_train_samples + samples})
    return {**trainer_state, "iteration": trainer_state["iteration"] + 1, "args": args,
            "opt_param_scheduler": {**trainer_state["opt_param_scheduler"], "num_steps": args.consumed_train_samples}}  # fmt: skip


def save_muon(model, optimizer, root: Path, trainer_state: dict, samples: int) -> None:
    """Model and Muon chain saved as Megatron-LM's torch_dist save writes them (its
    _build_sharded_state_dict_metadata: no distributed optimizer, chained_optim_avoid_prefix, so
    each chained optimizer's tensors under the model-space `optimizer.state.<slot>.<key>`), one
    iteration and `samples` samples after `trainer_state`, and the pointer."""
    from megatron.core import dist_checkpointing

    state = one_step_on(trainer_state, samples)
    iteration = state["iteration"]
    directory = root / f"iter_{iteration:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    model_state = model.sharded_state_dict()
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    dist_checkpointing.save({"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, metadata=metadata), **state}, str(directory))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


TP2_ARCH = "llama"
"""The model save_muon_tp2 steps and saves at tp 2: SwiGLU (linear_fc1 is [gate; fc1] of each
tp rank, put together by megatron-core's factory), grouped-query attention, untied head."""


def save_muon_tp2(root: Path) -> None:
    """In the family launch (tp 2): TP2_ARCH's Muon chain after one synthetic step (gradients
    sin(7 w), tests/megatron_adam.py), saved under root as save_muon does; root/held.pt: the
    weights and MUON_SLOTS it holds, each tensor whole (held_whole)."""
    if not available():
        return
    muon = load_muon_module()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests.megatron_adam import ADAM, patch_for_optimizer, synthetic_step
    from tests.megatron_gpt import LAYERS, build, trainer_state

    patch_for_optimizer()
    tp = dist.get_world_size()
    model = build(tp, True, LAYERS, TP2_ARCH)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = muon.get_megatron_muon_optimizer(OptimizerConfig(optimizer="muon", min_lr=0.0, **ADAM, **MUON), [ddp])
    synthetic_step(model, ddp, optimizer)
    save_muon(model, optimizer, root, trainer_state(tp, LAYERS, TP2_ARCH, untied=True), 0)
    held = held_whole(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(held, root / "held.pt")
    parallel_state.destroy_model_parallel()


def held_whole(model, optimizer) -> dict:
    """{"weight", *MUON_SLOTS} -> {Megatron key: the whole tensor, layers stacked}: each rank puts
    its shards where its sharded state dict says they go (a factory's, linear_fc1's, as it
    builds them), replicas once, and the ranks sum."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    out: dict[str, dict] = {}
    for sharded in model.sharded_state_dict().values():
        if not isinstance(getattr(sharded, "data", None), torch.nn.Parameter):
            continue  # _extra_state
        states = chained_states(optimizer, sharded.data)
        for slot, value in {"weight": sharded.data, **{k: states[k] for k in MUON_SLOTS if k in states}}.items():
            if hasattr(sharded, "build_fn"):  # a factory: its pieces hold views of the value given
                pieces = [(piece, piece.data) for piece in nested_values(sharded.build_fn(sharded.key, value, sharded.replica_id, None))]
            else:
                pieces = [(sharded, value)]
            for piece, data in pieces:
                whole = out.setdefault(slot, {}).setdefault(piece.key, torch.zeros(piece.global_shape))
                replica = piece.replica_id if isinstance(piece.replica_id, tuple) else (piece.replica_id,)
                if not any(replica):
                    sizes = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
                    whole[tuple(slice(o, o + n) for o, n in zip(piece.global_offset, sizes))] = data.detach().reshape(sizes)
    for keys in out.values():
        for whole in keys.values():
            dist.all_reduce(whole)
    return out


def write_muon_params(path: Path) -> None:
    """path: {arch: {"muon": [names], "qkv": [names split by QKV]}}, Megatron's parameter names;
    nothing when emerging-optimizers (the builder's dependency) is not installed, or on another
    megatron-core than 0.16.1."""
    if not available():
        return
    from megatron.core import parallel_state

    from tests.megatron_gpt import LAYERS, build

    found = {}
    for arch, untied in MUON_ARCHS:
        model = build(dist.get_world_size(), untied, LAYERS, arch)
        found[arch] = muon_params(model)
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        path.write_text(json.dumps(found, indent=1))


def muon_params(model) -> dict[str, list[str]]:
    """{"muon": [names], "qkv": [those split by QKV], "experts": {name: matrices}}: what
    get_megatron_muon_optimizer gives Muon on `model` (its TensorParallelMuon optimizers, the
    experts' one included), Megatron's parameter names; each SequentialMLP expert's weight is a
    matrix of its own, counted under its torch_dist name (local_experts.<i>. -> experts.)."""
    muon = load_muon_module()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests.megatron_adam import patch_for_optimizer

    patch_for_optimizer()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    chained = muon.get_megatron_muon_optimizer(OptimizerConfig(lr=1e-3, min_lr=0.0), [ddp])
    names = {id(p): name.removeprefix("module.") for name, p in ddp.named_parameters()}
    muons = [o.optimizer for o in chained.chained_optimizers if isinstance(o.optimizer, muon.TensorParallelMuon)]
    given = [p for o in muons for group in o.param_groups for p in group["params"]]
    experts: dict[str, int] = {}
    for p in given:
        if getattr(p, "expert_tp", False):
            stacked = re.sub(r"\.local_experts\.\d+\.", ".experts.", names[id(p)])
            experts[stacked] = experts.get(stacked, 0) + 1
    return {"muon": sorted(re.sub(r"\.local_experts\.\d+\.", ".experts.", names[id(p)]) for p in given),
            "qkv": sorted(names[id(p)] for p in given if getattr(p, "is_qkv", False)), "experts": experts}  # fmt: skip


def write_mla_moe_muon_params(model, path: Path) -> None:
    """path: muon_params of tests/megatron_mla_gpt.py's model (multi-latent attention, SequentialMLP
    experts, a shared expert, a prediction module), where the builder runs (see write_muon_params)."""
    if available():
        found = muon_params(model)
        if dist.get_rank() == 0:
            path.write_text(json.dumps(found, indent=1))
