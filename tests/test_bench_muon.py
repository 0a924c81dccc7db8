"""scripts/bench_muon.py: dtgpt's Muon step beside torch.optim.Muon, run with tiny arguments; its
table parses, and the matrix products (the GEMM kernels a GPU would launch) are counts, not times:
on the dense model dtgpt's Megatron matrices (the QKV split in three, K and V in one batched
iteration; [gate; fc1] one) take as many as torch's (QKV one, gate and fc1 two), and the MoE
model's stacked experts fewer than one iteration per expert. No timing is asserted."""

import pytest

from tests.runs import load_script


def test_bench_muon_prints_both_models_and_counts_products(capsys):
    bench = load_script("bench_muon")
    assert bench.main(["--layers", "2", "--experts", "4", "--steps", "1", "--rounds", "1", "--warmup", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == bench.HEADER.split()
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[2:]}
    assert set(rows) == {"dense", "moe"}
    for ms, ref_ms, host, ops, ref_ops, ops_ratio, mm, ref_mm, mm_ratio in rows.values():
        assert ms > 0 and ref_ms > 0 and host == pytest.approx(ms / ref_ms, abs=0.01)
        assert ops_ratio == pytest.approx(ops / ref_ops, abs=0.01) and mm_ratio == pytest.approx(mm / ref_mm, abs=0.01)
    steps = 3 * bench.NS_STEPS  # products per Newton-Schulz iteration: X X^T, then two addmm
    assert rows["dense"][6] == rows["dense"][7] == (2 * 5 + 1) * steps  # 5 iterations a block, the position embedding
    # per block: q, k+v, proj, the router, fc1 and fc2 of 4 experts batched; torch: qkv, proj, router, 4 x 2
    assert rows["moe"][6] == (2 * 6 + 1) * steps and rows["moe"][7] == (2 * 11 + 1) * steps


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--models", "sparse"], "--models='sparse': 'sparse' is not dense or moe"),
        (["--experts", "1"], "--experts=1 must be 2 or more"),
        (["--steps", "0"], "--steps=0 must be 1 or more"),  # divided by zero
        (["--hidden", "15"], "--hidden=15 must be a multiple of --heads=2"),  # a model traceback
    ],
)
def test_bench_muon_options_out_of_range_are_one_error_line(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        load_script("bench_muon").main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err.splitlines()[-1]
