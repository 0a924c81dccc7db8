"""Megatron's --optimizer muon (dtgpt/muon.py) against megatron-core 0.16.1's TensorParallelMuon on
emerging-optimizers 0.3.0 (tests/muon_oracle.py), one process: the same matrices and gradients,
a few steps, the same final parameters (an MoE layer's stacked experts against megatron-core's
matrix per expert too). Which parameters take Muon is compared with megatron-core's builder on
its GPTModel in tests/test_megatron_family.py and on its MLA + MoE model in
tests/test_megatron_mla_muon.py; every layout against one process in tests/test_parity.py
and tests/test_parity_deepseek.py; the refusals below.
"""

from __future__ import annotations

import pytest
import torch

from dtgpt.cli import run_main
from dtgpt.config import OptimizerConfig, load_config
from dtgpt.config.muon_rules import COEFFICIENT_TYPES
from dtgpt.muon import MUON, NEWTON_SCHULZ_COEFFICIENTS, MuonMatrices, MuonWithAdamW
from dtgpt.muon_owners import owners
from tests.muon_oracle import load

GROUPS, QUERIES, HEAD = 2, 2, 4  # 2 query groups of 2 query heads, head_dim 4
SPLIT = (QUERIES * HEAD, HEAD, HEAD)
HIDDEN, FFN, STEPS, LR, WD = 16, 24, 3, 0.02, 0.1


def matrices() -> dict[str, torch.Tensor]:
    """A QKV weight (rows [group, (q, q, k, v), head_dim]), a wide and a tall matrix, seeded."""
    g = torch.Generator().manual_seed(0)
    shapes = {"qkv": (GROUPS * sum(SPLIT), HIDDEN), "wide": (HIDDEN, FFN), "tall": (FFN + 16, HIDDEN)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def gradients(step: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(t.shape, generator=g) for name, t in like.items()}


def train(build, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = {name: torch.nn.Parameter(t.clone()) for name, t in start.items()}
    optimizer = build(params)
    for step in range(STEPS):
        for name, grad in gradients(step, start).items():
            params[name].grad = grad
        optimizer.step()
    return {name: p.detach() for name, p in params.items()}


def megatron_core(cfg: OptimizerConfig):
    muon = load()

    def build(params):
        qkv = params.get("qkv")
        return muon.TensorParallelMuon(
            list(params.values()), lr=LR, momentum_beta=cfg.muon_momentum, use_nesterov=cfg.muon_nesterov, weight_decay=WD,
            split_qkv=cfg.muon_split_qkv, is_qkv_fn=lambda p: p is qkv, qkv_split_shapes=SPLIT,
            fp32_matmul_prec=cfg.muon_fp32_matmul_prec, coefficient_type=cfg.muon_coefficient_type,
            num_ns_steps=cfg.muon_num_ns_steps, scale_mode=cfg.muon_scale_mode, extra_scale_factor=cfg.muon_extra_scale_factor,
        )  # fmt: skip

    return build


def dtgpt(cfg: OptimizerConfig):
    def build(params):
        group = {"params": list(params.values()), "weight_decay": WD, MUON: True}
        return MuonWithAdamW([group], muon=cfg, matrices=MuonMatrices({id(params["qkv"]): SPLIT}, {}), lr=LR, weight_decay=WD)

    return build


CASES = {
    "defaults": {},  # Megatron's: momentum 0.9, split QKV, no Nesterov, quintic x 5, spectral, bf16 iteration
    "nesterov": {"muon_nesterov": True},
    "no_split_qkv": {"muon_split_qkv": False},
    "nesterov_no_split_fp32": {"muon_nesterov": True, "muon_split_qkv": False, "muon_fp32_matmul_prec": "high"},
    # polar_express's 8 sets then its last repeated; the other scale modes and the extra factor
    "options_fp32": {"muon_coefficient_type": "polar_express", "muon_num_ns_steps": 10, "muon_scale_mode": "shape_scaling",
                     "muon_extra_scale_factor": 0.2, "muon_momentum": 0.95, "muon_fp32_matmul_prec": "high"},
    "unit_rms_norm_simple": {"muon_scale_mode": "unit_rms_norm", "muon_coefficient_type": "simple", "muon_num_ns_steps": 3},
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_muon_steps_as_megatron_core(case):
    """Three steps with decoupled weight decay from the same start and gradients: the same
    parameters as megatron-core's Muon (to 1e-6; they come out bitwise equal, the same operations in the
    same order)."""
    cfg = OptimizerConfig(optimizer="muon", **CASES[case])
    start = matrices()
    ours, theirs = train(dtgpt(cfg), start), train(megatron_core(cfg), start)
    for name in start:
        assert not torch.equal(theirs[name], start[name])
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=f"{case}: {name}")


def test_split_qkv_and_nesterov_change_the_update():
    """The cases above could not tell the options apart if they did nothing."""
    start = matrices()
    plain = train(dtgpt(OptimizerConfig(optimizer="muon")), start)
    for change in ({"muon_split_qkv": False}, {"muon_nesterov": True}):
        other = train(dtgpt(OptimizerConfig(optimizer="muon", **change)), start)
        assert not torch.allclose(other["qkv"], plain["qkv"], rtol=1e-3), change
    assert torch.equal(train(dtgpt(OptimizerConfig(optimizer="muon", muon_split_qkv=False)), start)["wide"], plain["wide"])


def test_every_coefficient_type_is_emerging_optimizers():
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    load()
    assert set(NEWTON_SCHULZ_COEFFICIENTS) == set(COEFFICIENT_TYPES)
    for kind, sets in NEWTON_SCHULZ_COEFFICIENTS.items():
        assert sets == muon_utils._COEFFICIENT_SETS[kind], kind


def test_swiglu_gate_and_fc1_step_as_megatrons_one_linear_fc1():
    """dtgpt keeps SwiGLU's gate and fc1 apart; Megatron's linear_fc1 is [gate; fc1], one matrix
    to orthogonalise. dtgpt's two after three steps are the halves of megatron-core's one."""
    cfg = OptimizerConfig(optimizer="muon", muon_nesterov=True)
    start = {"linear_fc1": matrices()["tall"][: 2 * 12], "fc2": matrices()["wide"]}  # [gate; fc1], 12 rows each

    def ours_build(params):
        gate, fc1 = (torch.nn.Parameter(half.detach().clone()) for half in params["linear_fc1"].chunk(2))
        inner = MuonWithAdamW([{"params": [gate, fc1, params["fc2"]], "weight_decay": WD, MUON: True}], muon=cfg,
                              matrices=MuonMatrices({}, {id(fc1): gate}), lr=LR, weight_decay=WD)  # fmt: skip

        class Halves:  # the fused parameter's gradient handed to the two halves, the result put back
            def step(self):
                gate.grad, fc1.grad = params["linear_fc1"].grad.chunk(2)
                inner.step()
                params["linear_fc1"].data = torch.cat([gate.detach(), fc1.detach()])

        return Halves()

    ours, theirs = train(ours_build, start), train(megatron_core(cfg), start)
    torch.testing.assert_close(ours["linear_fc1"], theirs["linear_fc1"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours["fc2"], theirs["fc2"], rtol=1e-6, atol=1e-7)


EXPERTS = 4


@pytest.mark.parametrize("case", ["defaults", "options_fp32"])
def test_stacked_experts_step_as_megatron_cores_one_matrix_per_expert(case):
    """dtgpt stacks an MoE layer's experts (fc1 (E, 2 ffn, h) with SwiGLU's [gate; fc1], fc2
    (E, h, ffn)); megatron-core's SequentialMLP holds each expert's linear_fc1 and linear_fc2 as
    matrices of their own. Three steps: each expert's slice is megatron-core's matrix (scaled by
    one expert's shape, normalised alone), batched Newton-Schulz against one matrix at a time."""
    cfg = OptimizerConfig(optimizer="muon", **CASES[case])
    g = torch.Generator().manual_seed(1)
    stacks = {"fc1": torch.randn(EXPERTS, 2 * 12, HIDDEN, generator=g), "fc2": torch.randn(EXPERTS, HIDDEN, 12, generator=g)}
    stacks["fc2"][1] *= 50  # an expert far from the others: normalised alone, not by the stack's norm
    per_expert = {f"{name}.{e}": stack[e] for name, stack in stacks.items() for e in range(EXPERTS)}

    def ours_build(params):
        mine = {name: torch.nn.Parameter(stack.clone()) for name, stack in stacks.items()}
        inner = MuonWithAdamW([{"params": list(mine.values()), "weight_decay": WD, MUON: True}], muon=cfg,
                              matrices=MuonMatrices({}, {}), lr=LR, weight_decay=WD)  # fmt: skip

        class Stacked:  # the experts' gradients stacked in, each expert's slice handed back out
            def step(self):
                for name, p in mine.items():
                    p.grad = torch.stack([params[f"{name}.{e}"].grad for e in range(EXPERTS)])
                inner.step()
                for key, param in params.items():
                    name, e = key.split(".")
                    param.data = mine[name].detach()[int(e)].clone()

        return Stacked()

    ours, theirs = train(ours_build, per_expert), train(megatron_core(cfg), per_expert)
    for key in per_expert:
        assert not torch.equal(theirs[key], per_expert[key])
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-6, msg=f"{case}: {key}")


def test_megatron_muon_flags_set_the_keys():
    """A Megatron Muon launch line: every --muon-* flag lands on its key; dist_muon and
    --use-distributed-optimizer are muon; core 0.16's --muon-use-nesterov is --muon-nesterov."""
    line = ("--optimizer dist_muon --use-distributed-optimizer --muon-momentum 0.95 --muon-no-split-qkv --muon-use-nesterov "
            "--muon-scale-mode shape_scaling --muon-fp32-matmul-prec high --muon-coefficient-type polar_express "
            "--muon-num-ns-steps 6 --muon-tp-mode distributed --muon-extra-scale-factor 0.2 --muon-scalar-optimizer adam")  # fmt: skip
    o = load_config(None, ["--mock-data", *line.split()]).optimizer
    assert o.uses_muon and (o.muon_momentum, o.muon_split_qkv, o.muon_nesterov, o.muon_scale_mode) == (0.95, False, True, "shape_scaling")
    assert (o.muon_fp32_matmul_prec, o.muon_coefficient_type, o.muon_num_ns_steps, o.muon_tp_mode) == ("high", "polar_express", 6, "distributed")
    assert o.muon_extra_scale_factor == 0.2 and load_config(None, ["--mock-data", "--muon-nesterov"]).optimizer.muon_nesterov
    plain = load_config(None, ["--mock-data", "--optimizer", "muon"]).optimizer  # Megatron's defaults
    assert (plain.muon_momentum, plain.muon_split_qkv, plain.muon_nesterov, plain.muon_fp32_matmul_prec) == (0.9, True, False, "medium")


@pytest.mark.parametrize(
    "args, message",
    [
        ("--muon-tp-mode blockwise --tensor-model-parallel-size 2", "error: --muon-tp-mode blockwise is refused at --tensor-model-parallel-size 2: it orthogonalises each tp shard alone"),
        ("--muon-scalar-optimizer lion", "error: --muon-scalar-optimizer lion is refused: dtgpt trains what Muon does not take"),
        ("--muon-fp32-matmul-prec low", "error: --muon-fp32-matmul-prec low is refused: torch's float32 matmul precision is 'medium'"),
        ("--fp16", "error: --optimizer muon is refused with --fp16: Megatron's Muon has no loss scaling"),
        ("--muon-coefficient-type custom", "error: --muon-coefficient-type custom is not one of: 'simple', 'quintic'"),
        ("--muon-num-ns-steps 0", "error: --muon-num-ns-steps 0 must be >= 1"),
        ("--muon-momentum 1.0", "error: --muon-momentum 1.0 must be in [0, 1)"),
    ],
    ids=["blockwise-tp2", "lion-scalar", "prec-low", "fp16", "custom-coefficients", "ns-steps", "momentum"],
)  # fmt: skip
def test_refused_muon_settings_are_one_error_line(capfd, args, message):
    code = run_main(["--mock-data", "--optimizer", "muon", *args.split()], None, None)
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(message) and "Traceback" not in err, err


def test_owners_balance_the_matrices_by_size():
    """dtgpt/muon_owners.py: the largest first, each to the least-loaded shard rank; equal keys spread."""
    assert owners([(8,), (4,), (4,), (2,), (2,)], 2) == [0, 1, 1, 0, 1]  # 10 elements each
    assert owners([(1,)] * 6, 4) == [0, 1, 2, 3, 0, 1]
    assert owners([(5,), (3,)], 4) == [0, 1]
