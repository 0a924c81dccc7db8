"""dtgpt's vocabulary-parallel cross-entropy (dtgpt/parallel/vocab_parallel_loss.py): on 2 gloo
ranks its per-token losses and its gradient of each rank's vocabulary block equal megatron-core's
`vocab_parallel_cross_entropy` and one process's F.cross_entropy, in fp32 and from bf16 logits,
with ignored labels (loss 0, no gradient) and labels at both blocks' edges; and nothing in its
forward or backward reads a value back to the host. Training under tp against one process:
tests/test_parity*.py."""

from __future__ import annotations

import pytest
import torch

from tests.runs import run_worker

pytestmark = pytest.mark.slow

# fp32: the same sums in another order. bf16 logits: each side computes in fp32 from the same
# bf16 values; the gradient is rounded to bf16 once (its ulp near 1 is 2**-8).
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=1e-5, atol=1e-6)}
GRAD_TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=2**-8, atol=2**-14)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("vocab_parallel_loss")
    run_worker("vocab_parallel_loss_worker.py", 2, out)
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("oracle", ["megatron", "plain"])
def test_losses_and_gradients_equal_the_oracles(ranks, dtype, oracle):
    for rank in ranks:
        r = rank[dtype]
        kept = r["kept"]
        losses, grad = r["dtgpt"]
        expected_losses, expected_grad = r[oracle]
        assert not kept.all() and kept.any()
        assert (losses[~kept] == 0).all()
        torch.testing.assert_close(losses[kept], expected_losses[kept], **TOLERANCE[dtype])
        assert grad.dtype == expected_grad.dtype
        assert (grad[~kept] == 0).all()  # an ignored token's row gets no gradient
        torch.testing.assert_close(grad, expected_grad, **GRAD_TOLERANCE[dtype])


def test_no_host_reads_in_forward_or_backward(ranks):
    assert [rank[dtype]["host_reads"] for rank in ranks for dtype in ("fp32", "bf16")] == [0, 0, 0, 0]
    assert all(rank[dtype]["counter_sees"] > 0 for rank in ranks for dtype in ("fp32", "bf16"))
