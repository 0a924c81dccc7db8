"""A Megatron checkpoint of the multi-latent attention + MoE + MTP model resumed in dtgpt: loaded
on 2 dtgpt ranks (tp 2, pp 2, ep 2) with megatron-core's logits, trained on as one process, and
with its Adam state (model space, chained, dp_reshardable buckets) taking megatron-core's own
next step (tests/megatron_mla_adam.py, in conftest's mla_root launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtgpt.checkpoint.megatron import find
from dtgpt.checkpoint.megatron.keys import OPTIMIZER_PREFIX, stored_alias
from dtgpt.checkpoint.megatron.reader import MegatronReader
from tests.megatron_gpt import CONSUMED, ITERATION
from tests.megatron_mla_gpt import LAYERS
from tests.megatron_mla_oracle import ADAM_RUN, MODEL, STEPS, TRAIN_ON, assert_same_outputs
from tests.parity_oracle import assert_same_figures, assert_same_training
from tests.runs import Command, launch_commands, read_run, run_args
from tests.test_checkpoint_convert import load_script

LOADED_LAYOUTS = ("tp2", "pp2", "ep2")
"""dtgpt meshes of 2 ranks the Megatron checkpoints load into (tests/megatron_family_worker.py)."""
STAGES = {"pp2": {"pipeline_layers_per_stage": [1, LAYERS - 1]}}
"""Megatron's split at pp 2 (decoder_first_pipeline_num_layers=1): the dense layer, then the two MoE layers and the MTP block."""
TRAINED_ON = {"one": (1, []), "tp2": (2, ["--parallel.tensor_model_parallel_size=2", "--parallel.sequence_parallel=true"]),
              "pp2": (2, ["--parallel.pipeline_model_parallel_size=2", "--parallel.pipeline_layers_per_stage=[1,2]"])}  # fmt: skip
ADAM_ON = {"adam_one": (1, [], "megatron_adam"), "adam_pp2": (*TRAINED_ON["pp2"], "megatron_adam"),
           "adam_tp2": (*TRAINED_ON["tp2"], "megatron_adam"), "adam_chained": (1, [], "megatron_adam_chained"),
           "adam_dp_reshardable": (1, [], "megatron_adam_dp_reshardable")}  # fmt: skip
"""run: (ranks, mesh, the checkpoint it resumes from); megatron_adam_chained: the chained
optimizers' tensors under the prefixes megatron-core gave them before chained_optim_avoid_prefix;
megatron_adam_dp_reshardable: the same state in Megatron-LM's default layout (flat buckets)."""
BUCKETS_READ = "optimizer state read from the distributed optimizer's dp_reshardable buckets (local layer order, SequentialMLP experts)"


@pytest.fixture(scope="module")
def mla_on_dtgpt_meshes(mla_root, tmp_path_factory) -> dict:
    """One launch per rank count (tests/runs.py): on 2 ranks the checkpoint loads of
    tests/megatron_family_worker.py (torch_dist and per-rank at LOADED_LAYOUTS), then train.py on
    from megatron-core's torch_dist checkpoint at tp 2 + SP and pp 2; on one process the same run.
    {key: Finished}; the runs' directories by key under "directories"."""
    jobs = [[str(mla_root / root), MODEL, list(LOADED_LAYOUTS), STAGES] for root in ("megatron", "megatron_per_rank")]
    commands = [Command("loads", tmp_path_factory.mktemp("loads"), [json.dumps(jobs)], 2, call="tests.megatron_family_worker:main")]
    directories = {}
    for name, (nproc, mesh) in TRAINED_ON.items():
        directories[name] = tmp_path_factory.mktemp(name)
        argv = run_args(directories[name], [*mesh, f"--checkpoint.load={mla_root / 'megatron'}"], name, TRAIN_ON, 0)
        commands.append(Command(name, directories[name], argv, nproc))
    for name, (nproc, mesh, saved) in ADAM_ON.items():
        directories[name] = tmp_path_factory.mktemp(name)
        argv = run_args(directories[name], [*mesh, f"--checkpoint.load={mla_root / saved}"], name, ADAM_RUN, 0)
        commands.append(Command(name, directories[name], argv, nproc))
    return {**launch_commands(commands), "directories": directories}


@pytest.mark.slow
def test_megatron_mla_moe_mtp_checkpoints_load_into_dtgpt_at_tp2_pp2_and_ep2(mla_root, mla_on_dtgpt_meshes):
    """checkpoint.load of megatron-core's torch_dist and per-rank (tp 2) checkpoints of the MLA +
    MoE + MTP model on 2 dtgpt ranks: at tp 2 with sequence parallelism (the MoE blocks' experts
    and routers with the expert bias split as every block's), at pp 2 (the MTP block and the
    embedding copy it reads on the last stage, which embeds the tokens itself) and with the
    experts over ep 2: the main model's and the MTP depth's logits, the LM loss and the MTP loss
    are megatron-core's."""
    mla_on_dtgpt_meshes["loads"].checked()
    for root in ("megatron", "megatron_per_rank"):
        for name in LOADED_LAYOUTS:
            assert_same_outputs(torch.load(mla_root / root / f"{name}_logits.pt", weights_only=True), mla_root)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_megatron_mla_moe_mtp_checkpoint_trains_on_at_tp2_and_pp2_as_one_process(mla_root, mla_on_dtgpt_meshes, name):
    """train.py resumed from megatron-core's weights-only checkpoint goes on from its iteration and
    consumed samples; its first loss and MTP loss are megatron-core's own on that global batch, and
    at tp 2 + SP and pp 2 the loss, MTP loss, gradient norm and router statistics of each iteration
    are one process's. Resumed from the checkpoint with Adam state (tests/megatron_mla_adam.py), it
    trains as one process does, every parameter after the step too (tests/parity_oracle.py). Not
    the weights-only runs' parameters (assert_same_figures): a tp 2 sum order moved one element of
    2560 by 4.3e-6 on one CPU (1.01e-5 of its tensor), not on another."""
    runs = {}
    for key in ("one", name, "adam_one", f"adam_{name}"):
        run = read_run(mla_on_dtgpt_meshes["directories"][key], key)
        runs[key] = {**run, "params": {i: run["params"][ITERATION + i] for i in range(1, STEPS + 1) if ITERATION + i in run["params"]}}
    for key in ("one", name):
        output = mla_on_dtgpt_meshes[key].checked()
        assert f"loaded Megatron checkpoint {mla_root / 'megatron'}/iter_{ITERATION:07d}: iteration {ITERATION}, consumed samples {CONSUMED}" in output
    one = runs["one"]
    assert one["iteration"] == [ITERATION + 1 + i for i in range(STEPS)] and one["consumed_samples"][0] == CONSUMED + 8
    theirs = torch.load(mla_root / "batch_losses.pt", weights_only=True)  # [LM loss, mtp_1 loss]
    assert one["loss"][0] == pytest.approx(theirs[0].item(), rel=1e-5)
    assert one["mtp_1 loss"][0] == pytest.approx(theirs[1].item(), rel=1e-5)
    assert_same_figures(runs[name], one, STEPS)
    mla_on_dtgpt_meshes[f"adam_{name}"].checked()
    assert_same_training(runs[f"adam_{name}"], runs["adam_one"], 1)


def megatron_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the torch_dist checkpoint under root (model and optimizer.state.*), whole,
    by its key under the local layer spec (Transformer Engine's fused norm names mapped back)."""
    directory = find(root)
    reader = FileSystemReader(str(directory))
    shapes = {k: m.size for k, m in reader.read_metadata().state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    tensors = {key: torch.empty(shape) for key, shape in shapes.items()}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    out = {}
    for key, value in tensors.items():
        slot = next((f"{OPTIMIZER_PREFIX}{s}." for s in ("exp_avg_sq", "exp_avg", "param") if key.startswith(f"{OPTIMIZER_PREFIX}{s}.")), "")
        name = key.removeprefix(slot)
        out[slot + (stored_alias(name) if name.endswith("layer_norm_weight") else name)] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ADAM_ON))
def test_megatron_mla_moe_mtp_adam_state_loads_and_steps_on_as_megatron_core(mla_root, mla_on_dtgpt_meshes, tmp_path, name):
    """megatron-core's distributed optimizer (dense and expert optimizers chained, dp 2 x ep 2)
    saves the MLA + MoE + MTP model with its Adam state, then takes its next step; train.py
    resumed from the saved checkpoint (one process; tp 2 + SP; pp 2, the MTP block and its copy of the
    embedding on the last stage; one process from the chained_<i>.-prefixed save, and from the
    dp_reshardable buckets of Megatron-LM's default layout) takes the same
    step: its LR from the checkpoint's schedule, the same LM loss, MTP loss and gradient norm, and
    after it the same weights, master weights, Adam moments and expert biases, tensor by tensor
    (to-megatron puts dtgpt's in megatron-core's keys)."""
    output = mla_on_dtgpt_meshes[name].checked()
    assert "optimizer state loaded: fp32 master weights (param), Adam moments, step 1" in output
    assert (BUCKETS_READ in output) == (name == "adam_dp_reshardable")
    saved = mla_root / ADAM_ON[name][2]
    assert f"loaded Megatron checkpoint {saved}/iter_{ITERATION:07d}: iteration {ITERATION}, consumed samples {CONSUMED}" in output
    directory = mla_on_dtgpt_meshes["directories"][name]
    run = read_run(directory, name)
    assert run["iteration"] == [ITERATION + 1] and run["consumed_samples"] == [CONSUMED + 8]
    groups = MegatronReader(find(mla_root / "megatron_adam")).common["optimizer"][0]["optimizer"]["param_groups"]  # every save's
    assert run["lr"][0] == pytest.approx(groups[0]["lr"], rel=1e-12)  # cosine decay at 48 samples: 5.5e-4
    loss, mtp_loss, grad_norm = torch.load(mla_root / "adam_step.pt", weights_only=True).tolist()
    assert run["loss"][0] == pytest.approx(loss, rel=1e-6) and run["mtp_1 loss"][0] == pytest.approx(mtp_loss, rel=1e-6)
    assert run["grad_norm"][0] == pytest.approx(grad_norm, rel=1e-5)
    assert load_script().main(["to-megatron", str(directory / f"{name}_ckpt"), str(tmp_path / "m")]) == 0
    ours, theirs = megatron_tensors(tmp_path / "m"), megatron_tensors(mla_root / "megatron_adam_stepped")
    assert ours.keys() == theirs.keys()
    model_keys = {k for k in theirs if not k.startswith(OPTIMIZER_PREFIX)}
    biases = {k for k in model_keys if k.endswith("router.expert_bias")}  # buffers, moved by the step
    assert len(biases) == 3 and {k.removeprefix(f"{OPTIMIZER_PREFIX}exp_avg.") for k in theirs if ".exp_avg." in k} == model_keys - biases
    for key, value in theirs.items():
        error = ((ours[key] - value).norm() / value.norm()).item()
        assert error <= 1e-5, (key, error)

