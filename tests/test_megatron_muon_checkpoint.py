"""A Megatron --optimizer muon checkpoint resumes in dtgpt with its state, megatron-core the oracle.

megatron-core (tests/megatron_muon.py step_muon, in the launch of tests/test_sgd.py) steps its
GPTModel with get_megatron_muon_optimizer's chain (TensorParallelMuon for the matrices, Adam for
the rest, each an FP32Optimizer) three times on dtgpt's mock samples 56-79, and after the first
step saves model and optimizer as Megatron-LM's torch_dist save does: Muon's momentum_buffer and
Adam's exp_avg, exp_avg_sq in model space, Adam's common_step in common.pt. dtgpt loads that
checkpoint (iteration 8, consumed samples 64) under --optimizer muon and trains the two batches
megatron-core trained next: the loss and gradient norm of each, and every weight after them, are
megatron-core's; in one process and at tp 2 and dp_shard 2 (FSDP: each matrix orthogonalised by
its owner). Without the state (fresh momentum and moments, measured) the second loss is 1e-3
off and the weights 0.03-0.1 relative (matrices), up to 0.6 (biases).
"""

from __future__ import annotations

import pytest
import torch

from dtgpt.api import build_model, build_train_state, init_distributed, train_step
from dtgpt.checkpoint import Checkpointer, layout
from dtgpt.checkpoint.export import read_sections
from dtgpt.checkpoint.megatron import find
from dtgpt.checkpoint.megatron.keys import full_model_shapes, half_of, megatron_name
from dtgpt.checkpoint.megatron.keys import MOMENTS, MOMENTUM
from dtgpt.checkpoint.megatron.load import state_slots
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import load_config
from dtgpt.faults.injection import build_faults
from tests.megatron_adam import BATCH, SGD_STEPS, mock_batch
from tests.megatron_gpt import CONSUMED, ITERATION, VOCAB
from tests.megatron_muon import FROM_DTGPT, MUON_PER_RANK, MUON_SAVED
from tests.runs import Command, launch_commands, read_metrics
from tests.megatron_checkpoints import ADAM_RUN, ROWS, model_cfg, without_key_bias
from tests.test_sgd import MUON_FLAGS, stacked_by_key, stacked_weights

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

SAVED_AT = ITERATION + 1  # megatron-core's save: after its first step
LOADED = "optimizer state loaded: Muon momentum, Adam moments, step 1"
MESHES = {"tp2": ["--parallel.tensor_model_parallel_size=2"], "dp_shard2": ["--parallel.data_parallel_shard_size=2"]}
"""dtgpt's 2-rank meshes that resume megatron-core's Muon checkpoint (one launch)."""


@pytest.fixture(scope="module")
def oracle(megatron_steps) -> dict:
    """megatron-core's muon.pt: its state as saved, each step's loss and gradient norm, the final weights."""
    if not (megatron_steps / "muon.pt").exists():
        pytest.skip("megatron-core's Muon needs emerging-optimizers (make setup) and megatron-core 0.16.1")
    return torch.load(megatron_steps / "muon.pt", weights_only=True)


def weight_errors(ours: dict, theirs: dict) -> dict[str, float]:
    """Per Megatron key, dtgpt's weights against megatron-core's, relative (the QKV bias's key rows
    left out: their gradient is zero up to rounding, both sides step by noise there)."""
    return {key: ((without_key_bias(key, ours[key]) - b).norm() / b.norm()).item()
            for key, b in ((key, without_key_bias(key, t)) for key, t in theirs.items())}  # fmt: skip


def test_megatron_muon_state_reads_as_megatron_core_held_it(megatron_steps, oracle):
    """Each dtgpt parameter's state reads from the checkpoint bit for bit as megatron-core's chain
    held it when it saved: Muon's momentum for the matrices dtgpt's Muon takes (the position
    embedding among them), Adam's moments for the rest."""
    reader = MegatronReader(find(megatron_steps / MUON_SAVED))
    shapes = full_model_shapes(model_cfg(), ROWS)
    reader.check(shapes, list(shapes))
    held = oracle["saved"]
    slots_read = set()
    for name, shape in shapes.items():
        key, layer = megatron_name(name)
        for slot in state_slots(name, shape, muon=True):
            theirs = held[slot][key] if layer is None else held[slot][key][layer]
            assert torch.equal(reader.tensor(name, shape, slot), theirs), (name, slot)
            slots_read.add((key, slot))
    assert {(key, MOMENTUM) for key in held[MOMENTUM]} | {(key, m) for m in MOMENTS for key in held[m]} == slots_read


def resume(root, flags: list[str], capsys, saved: str = MUON_SAVED):
    """dtgpt's train state after loading megatron-core's Muon checkpoint (root/`saved`) with
    `flags` (one process), and the load log."""
    cfg = load_config(None, [*ADAM_RUN, *flags, f"--checkpoint.load={root / saved}"])
    runtime = init_distributed(cfg)
    state = build_train_state(cfg, build_model(cfg, runtime, VOCAB))
    Checkpointer(state, cfg, runtime, build_faults(cfg.faults, runtime.rank, runtime.restart_count))
    return cfg, state, capsys.readouterr().out


def test_megatron_muon_checkpoint_steps_on_as_megatron_core(megatron_steps, oracle, capsys):
    """One process: the two steps after the save give megatron-core's losses and gradient norms,
    and its weights (measured: losses and norms within 2e-7 relative, weights within 6e-7)."""
    cfg, state, log = resume(megatron_steps, MUON_FLAGS, capsys)
    assert LOADED in log and (state.progress.iteration, state.progress.consumed_samples) == (SAVED_AT, CONSUMED + BATCH)
    for k in range(1, SGD_STEPS):
        result = train_step(cfg, state, mock_batch(CONSUMED + k * BATCH))
        assert result.loss == pytest.approx(oracle["losses"][k], rel=1e-6)
        assert result.grad_norm == pytest.approx(oracle["grad_norms"][k], rel=1e-6)
    errors = weight_errors(stacked_weights(state.model), oracle["weight"])
    assert max(errors.values()) <= 1e-5, errors


def test_a_megatron_muon_checkpoint_into_adamw_starts_fresh_and_says_why(megatron_steps, capsys):
    """Under optimizer.optimizer = "adam" Muon's matrices have no Adam moments in the checkpoint:
    AdamW starts fresh, and the log names the first missing tensor and what the checkpoint holds."""
    _, _, log = resume(megatron_steps, [], capsys)
    assert ("optimizer state not read: the checkpoint holds no optimizer.state.exp_avg.embedding.position_embeddings.weight, "
            "which dtgpt's AdamW needs (it holds Muon or SGD state: saved with another --optimizer?); fresh AdamW moments") in log


def test_megatron_muon_per_rank_state_is_one_line_and_fresh(megatron_steps, capsys):
    """The per-rank format (--ckpt-format torch) keeps the chain's state as a list of two torch
    state dicts by parameter index, which dtgpt does not map: the weights load, Muon and AdamW
    start fresh, and the log says why in one line naming the file."""
    _, _, log = resume(megatron_steps, MUON_FLAGS, capsys, MUON_PER_RANK)
    file = layout.iteration_dir(megatron_steps / MUON_PER_RANK, SAVED_AT) / "mp_rank_00" / "model_optim_rng.pt"
    assert (f"optimizer state not read: {file} holds several chained optimizers (MoE experts, or Muon and its Adam), "
            "which dtgpt does not map yet; fresh Muon momentum and AdamW moments") in log


@pytest.fixture(scope="module")
def resumed_on_two_ranks(megatron_steps, oracle, tmp_path_factory) -> dict:
    """train.py resuming megatron-core's Muon checkpoint on each of MESHES for its two steps
    (one 2-rank launch). {mesh: (output, metrics, stacked final weights)}."""
    commands = []
    for name, mesh in MESHES.items():
        directory = tmp_path_factory.mktemp(f"muon_{name}")
        argv = [*ADAM_RUN, *MUON_FLAGS, *mesh, f"--training.train_iters={ITERATION + SGD_STEPS}", f"--checkpoint.load={megatron_steps / MUON_SAVED}",
                f"--checkpoint.save={directory}/ckpt", f"--logging.metrics_file={directory}/m.jsonl"]  # fmt: skip
        commands.append(Command(name, directory, argv, 2))
    finished = launch_commands(commands)
    out = {}
    for c in commands:
        weights = read_sections(layout.iteration_dir(c.directory / "ckpt", ITERATION + SGD_STEPS), ("model",))["model"]
        out[c.key] = (finished[c.key].checked(), read_metrics(c.directory / "m.jsonl"), stacked_by_key(weights))
    return out


@pytest.mark.parametrize("mesh", list(MESHES))
def test_megatron_muon_checkpoint_steps_on_as_megatron_core_on_two_ranks(resumed_on_two_ranks, oracle, mesh):
    """tp 2 (each rank reads its rows of the momentum and moments) and dp_shard 2 (FSDP shards):
    the same losses, gradient norms and weights as megatron-core's two steps."""
    output, metrics, weights = resumed_on_two_ranks[mesh]
    assert LOADED in output
    assert [m["iteration"] for m in metrics] == [SAVED_AT + 1, SAVED_AT + 2]
    for record, loss, norm in zip(metrics, oracle["losses"][1:], oracle["grad_norms"][1:]):
        assert record["loss"] == pytest.approx(loss, rel=1e-5) and record["grad_norm"] == pytest.approx(norm, rel=1e-5), record
    errors = weight_errors(weights, oracle["weight"])
    assert max(errors.values()) <= 1e-5, errors


def test_dtgpt_muon_checkpoint_goes_to_megatron_core_with_its_state(megatron_steps, oracle):
    """to-megatron writes a dtgpt Muon run's momentum and Adam moments where megatron-core's Muon
    chain keeps them (tests/megatron_muon.py write_dtgpt_muon, before the launch): megatron-core
    loads it (load_muon) and then holds dtgpt's weights, momentum, moments and step bit for bit;
    and dtgpt reads the written state back as it was."""
    saved = read_sections(layout.iteration_dir(megatron_steps / "dtgpt", 1), ("model", "optimizer"))
    loaded = torch.load(megatron_steps / FROM_DTGPT / "loaded_muon.pt", weights_only=True)
    ours = {"weight": stacked_by_key(saved["model"])}
    for slot in (MOMENTUM, *MOMENTS):
        ours[slot] = stacked_by_key({k[len("state."):-len(slot) - 1]: v for k, v in saved["optimizer"].items() if k.endswith(f".{slot}")})
    assert ours.keys() <= loaded.keys() and loaded["step"] == {1.0}
    for slot, keys in ours.items():
        assert keys.keys() == loaded[slot].keys(), slot
        for key, value in keys.items():
            assert torch.equal(value, loaded[slot][key]), (slot, key)
    reader = MegatronReader(find(megatron_steps / FROM_DTGPT))
    shapes = full_model_shapes(model_cfg(), ROWS)
    reader.check(shapes, list(shapes))
    for name, shape in shapes.items():
        for slot in state_slots(name, shape, muon=True):
            assert torch.equal(reader.tensor(name, shape, slot), saved["optimizer"][f"state.{name}.{slot}"]), (name, slot)


def test_megatron_muon_state_saved_at_tp2_reads_whole(family):
    """megatron-core's Muon chain saved at tp 2 (tests/megatron_muon.py save_muon_tp2, in the family
    launch: the Llama-style model, SwiGLU and grouped-query attention): each parameter's weight
    and state reads as the whole tensor megatron-core's ranks held, bit for bit; SwiGLU's gate and
    fc1 momentum as the two halves of linear_fc1's, which megatron-core puts together from each
    tp rank's [gate; fc1] rows."""
    from tests.megatron_muon import TP2_ARCH
    from tests.test_megatron_family import ROWS as ROWS_TP2
    from tests.test_megatron_family import model_cfg as family_cfg

    root = family / "llama_muon"
    if not (root / "held.pt").exists():
        pytest.skip("megatron-core's Muon needs emerging-optimizers (make setup) and megatron-core 0.16.1")
    held = torch.load(root / "held.pt", weights_only=True)
    reader = MegatronReader(find(root))
    shapes = full_model_shapes(family_cfg(TP2_ARCH), ROWS_TP2)
    reader.check(shapes, list(shapes))
    halves = 0
    for name, shape in shapes.items():
        key, layer = megatron_name(name)
        half = half_of(name, shapes)
        for slot in (None, *state_slots(name, shape, muon=True)):
            theirs = held[slot or "weight"][key] if layer is None else held[slot or "weight"][key][layer]
            if half is not None:
                theirs, halves = theirs.chunk(2)[half], halves + 1
            assert torch.equal(reader.tensor(name, shape, slot), theirs), (name, slot)
    assert halves == 2 * 2 * 2  # gate and fc1, weight and momentum, two layers
