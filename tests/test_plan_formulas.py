"""The planner's formulas: training time, activations per layer (Korthikanti's terms), pipeline
schedules (megatron-core's warm-up count as the oracle), and each optimizer's state bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dtgpt.config import interleaved_round_size, load_config
from dtgpt.plan import memory as pm
from dtgpt.plan import plan_layout
from dtgpt.plan.activations import ActivationShape, layer_activation_bytes, layer_activation_terms

def test_classic_time_formula():
    # Narayanan et al. 2021: 300B tokens of 175B on 1024 GPUs at 140 TFLOP/s -> ~34 days.
    days = pm.classic_training_days(300e9, 175e9, 1024, 140)
    assert days == pytest.approx(33.9, abs=0.1)
    assert pm.classic_training_days(300e9, 175e9, 1024, 140, recompute=False) == pytest.approx(days * 6 / 8)


def test_activation_formulas():
    """Korthikanti's 34·s·b·h + 5·a·s²·b per layer, /t with SP; selective drops the a·s²·b term
    (the terms measured on the model: tests/test_activation_memory.py)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    base = dict(seq_length=s, micro_batch_size=b, hidden_size=h, num_heads=a, padded_vocab=51200)
    none, sp, tp_only = (ActivationShape(**base, tp=n, sequence_parallel=q) for n, q in ((1, False), (t, True), (t, False)))
    assert layer_activation_bytes(none, "none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert layer_activation_bytes(sp, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert layer_activation_bytes(tp_only, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer_activation_bytes(none, "selective") == pytest.approx(sbh * 34)
    assert layer_activation_bytes(sp, "selective") == pytest.approx(sbh / t * 34)
    assert layer_activation_bytes(tp_only, "selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(sp, "full") == pytest.approx(2 * sbh / t)
    assert layer_activation_bytes(tp_only, "full") == pytest.approx(2 * sbh)
    # Which terms apply: a dropout of p = 0 keeps no mask (nor, for attention, a dropped copy);
    # a fused kernel keeps no scores; dtgpt's SP keeps the gathered QKV and fc1 inputs (not /t).
    quiet = ActivationShape(**base, tp=1, sequence_parallel=False, hidden_dropout=False, attention_dropout=False)
    assert layer_activation_bytes(quiet, "none") == pytest.approx(sbh * (32 + 2 * a * s / h))
    flash = ActivationShape(**base, tp=1, sequence_parallel=False, scores_kept=False)
    assert layer_activation_terms(flash, "none") == layer_activation_terms(none, "selective")
    dtgpt_sp = ActivationShape(**base, tp=t, sequence_parallel=True, megatron_sp=False)
    assert layer_activation_bytes(dtgpt_sp, "selective") == pytest.approx(sbh * (30 / t + 4))
    # fp32 doubles every activation but the 1-byte dropout masks; fp32_residual_connection the norm inputs
    fp32 = ActivationShape(**base, tp=1, sequence_parallel=False, compute_bytes=4)
    assert layer_activation_bytes(fp32, "none") == pytest.approx(sbh * (66 + (4 + 1 + 4) * a * s / h))
    fp32_residual = ActivationShape(**base, tp=1, sequence_parallel=False, residual_bytes=4)
    assert layer_activation_bytes(fp32_residual, "selective") == pytest.approx(sbh * 38)
    assert layer_activation_bytes(fp32_residual, "full") == pytest.approx(4 * sbh)


def test_schedule_formulas():
    assert [pm.chunks_in_flight("1F1B", 4, r, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert pm.chunks_in_flight("1F1B", 4, 0, 1, 2) == 2  # never more than the micro-batches
    assert pm.chunks_in_flight("GPipe", 4, 3, 1, 8) == 8
    # Interleaved: Korthikanti's first stage keeps pp·(1 + (pp-1)/(pp·v)) micro-batches of L/pp layers.
    pp, v = 4, 2
    chunks = pm.chunks_in_flight("Interleaved1F1B", pp, 0, v, 64)
    assert chunks / v == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
    assert pm.bubble_fraction("1F1B", 4, 1, 8) == pytest.approx(3 / 11)
    assert pm.bubble_fraction("GPipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert pm.bubble_fraction("Interleaved1F1B", 4, 2, 8) == pytest.approx(3 / 19)
    assert pm.bubble_fraction("1F1B", 1, 1, 8) == 0.0


def test_interleaved_in_flight_is_megatrons_warm_up_with_rounds_that_divide_the_count():
    """megatron-core's warm-up count (get_pp_rank_microbatches) with its
    microbatch_group_size_per_vp_stage set to the round size dtgpt runs, plus the steady chunk."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    pp, v = 4, 2
    for m in (2, 8, 10, 13, 14, 16):
        group = interleaved_round_size(m, pp)
        for r in range(pp):
            comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda r=r: r), virtual_pipeline_model_parallel_size=v)
            total, _, warmup, _ = get_pp_rank_microbatches(m, v, group, p2p_communicator=comm)
            assert pm.chunks_in_flight("Interleaved1F1B", pp, r, v, m) == min(warmup + 1, total), (m, r)


def test_plan_peaks_over_the_ramp_up_under_interleaving():
    """pp 4 x 2 virtual stages, batches 8, 10, 12, 14, 16: 14 runs in rounds of 7, so pp rank 0
    keeps more chunks in flight than at the final 16, and the plan says so."""
    ramp = ["--model.num_layers=8", "--model.hidden_size=24", "--model.num_attention_heads=2", "--model.seq_length=16",
            "--training.micro_batch_size=1", "--training.global_batch_size=16", "--training.rampup_batch_size=[8,2,40]",
            "--parallel.pipeline_model_parallel_size=4", "--parallel.virtual_pipeline_stages_per_rank=2",
            "--parallel.pipeline_schedule=Interleaved1F1B", "--data.mock_data=true"]  # fmt: skip
    plan = plan_layout(load_config(None, ramp), 4)
    first = next(r for r in plan.ranks if r.pp_rank == 0)
    assert first.in_flight == pm.chunks_in_flight("Interleaved1F1B", 4, 0, 2, 14) > pm.chunks_in_flight("Interleaved1F1B", 4, 0, 2, 16)
    assert any("14 micro-batches in rounds of 7" in note for note in plan.notes), plan.notes


def test_state_bytes():
    """fp32 at dp 1 (no FSDP); bf16 (FSDP at every dp: 2-byte gathered copies, fp32 gradients)."""
    fp32 = pm.state_bytes(1000, 1000, 100, compute_bytes=4, grad_bytes=4, fsdp=False, pipelined=True, reshard_after_forward=False)
    assert (fp32.params, fp32.copies, fp32.grads, fp32.adam) == (4000, 0, 4000, 8000)
    kw = dict(compute_bytes=2, grad_bytes=4, fsdp=True, pipelined=True, reshard_after_forward=False)
    one_rank = pm.state_bytes(1000, 1000, 100, **kw)  # a bf16 run on one rank per stage
    assert (one_rank.params, one_rank.copies, one_rank.grads, one_rank.adam) == (4000, 2000, 4000 + 4000, 8000)
    # FSDP over dp = 4 under pp: gathered bf16 params and fp32 unsharded gradients stay until the
    # last micro-batch.
    piped = pm.state_bytes(250, 1000, 100, **kw)
    assert (piped.params, piped.copies, piped.grads, piped.adam) == (1000, 2000, 1000 + 4000, 2000)
    # Without pp, resharding after forward: about two gathered units and one unit's gradients
    # (bf16 from backward, the fp32 buffer they are reduce-scattered from).
    alone = pm.state_bytes(250, 1000, 100, **{**kw, "pipelined": False, "reshard_after_forward": True})
    assert (alone.copies, alone.grads) == (2 * 2 * 100, 1000 + (2 + 4) * 100)
    fp16 = pm.state_bytes(250, 1000, 100, **{**kw, "grad_bytes": 2})  # fp16 reduced in fp16
    assert fp16.grads == 1000 + 2000


def test_sgd_state_is_its_momentum():
    """--optimizer sgd keeps one fp32 momentum buffer per parameter (none at momentum 0), not Adam's two."""
    base = ["--data.mock_data=true", "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4"]
    adam, sgd, plain = (plan_layout(load_config(None, base + extra), 2).ranks[0]
                        for extra in ([], ["--optimizer", "sgd"], ["--optimizer", "sgd", "--sgd-momentum", "0"]))  # fmt: skip
    assert adam.local_params > 0
    assert [r.memory["adam"] * pm.GIB for r in (adam, sgd, plain)] == pytest.approx([8 * adam.local_params, 4 * adam.local_params, 0])


def test_muon_state_is_one_momentum_for_its_matrices_and_adams_for_the_rest():
    """--optimizer muon: 4 bytes per element of a matrix Muon steps (every 2-D weight but the word
    embedding and the head: 12 h^2 per block and the position embedding), 8 for the rest."""
    base = ["--data.mock_data=true", "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4"]
    cfg = load_config(None, base)
    adam, muon = (plan_layout(load_config(None, base + extra), 2).ranks[0] for extra in ([], ["--optimizer", "muon"]))
    matrices = (2 * 12 * 32 * 32 + cfg.model.seq_length * 32) // 2  # positions: seq_length rows; FSDP: half on each rank
    assert muon.local_params == adam.local_params > 2 * matrices
    assert muon.memory["adam"] * pm.GIB == pytest.approx(4 * matrices + 8 * (adam.local_params - matrices))


