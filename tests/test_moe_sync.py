"""Host syncs per forward_backward (tests/sync_probe.py): one, the loss, for a dense GPT and for an
MoE GPT at any depth and micro-batch count; the MoE layer itself syncs nowhere (ep = 1: grouped
GEMM with device offsets; padded capacity: the loop too). Expert parallelism is counted on two
ranks by tests/moe_sync_worker.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import dtgpt
from tests.runs import REPO
from tests.sync_probe import SyncProbe

VOCAB = 128
MODEL = dict(hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
             make_vocab_size_divisible_by=64)  # fmt: skip
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01)
GROUPED = dict(MOE, moe_grouped_gemm=True)
PADDED = dict(MOE, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


def config(layers: int, micro_batches: int, model: dict):
    return dtgpt.make_config(
        model=dict(MODEL, num_layers=layers, **model),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        training=dict(micro_batch_size=2, global_batch_size=2 * micro_batches, train_iters=1),
        optimizer=dict(lr=1e-3, lr_decay_style="constant"),
    )


@pytest.fixture(scope="module")
def runtime():
    runtime = dtgpt.init_distributed(config(2, 1, {}))
    yield runtime
    dtgpt.shutdown()


def syncs(runtime, layers: int, micro_batches: int, model: dict) -> list[str]:
    cfg = config(layers, micro_batches, model)
    parts = dtgpt.build_model(cfg, runtime, vocab_size=VOCAB)
    batch = torch.randint(0, VOCAB, (2 * micro_batches, MODEL["seq_length"] + 1), generator=torch.Generator().manual_seed(0))
    dtgpt.forward_backward(parts, batch, micro_batches)  # a first call may set up what later ones reuse
    with SyncProbe() as probe:
        dtgpt.forward_backward(parts, batch, micro_batches)
    return probe.calls


@pytest.mark.parametrize("layers,micro_batches", [(2, 1), (4, 1), (2, 4)])
@pytest.mark.parametrize("kind", ["dense", "grouped", "padded_loop", "padded_grouped"])
def test_one_host_sync_per_forward_backward(runtime, kind, layers, micro_batches):
    model = {"dense": {}, "grouped": GROUPED, "padded_loop": PADDED, "padded_grouped": dict(PADDED, moe_grouped_gemm=True)}[kind]
    calls = syncs(runtime, layers, micro_batches, model)
    assert calls == ["item/bool/int/float"], calls  # the loss


def test_the_looped_dropless_experts_sync_once_per_layer_and_micro_batch(runtime):
    """Their per-expert slices need the counts on the host: documented, and counted here."""
    calls = syncs(runtime, 2, 2, MOE)
    assert sorted(calls) == sorted(["item/bool/int/float"] + ["tolist"] * 4), calls


def test_the_probe_counts_what_syncs():
    x = torch.arange(6.0)
    counts = torch.tensor([1, 2])
    cases = {
        "item/bool/int/float": [lambda: x.sum().item(), lambda: bool(x[0]), lambda: int(x[1]), lambda: float(x[1])],
        "nonzero": [lambda: x.nonzero()],
        "tolist": [lambda: x.tolist()],
        "cpu": [lambda: x.cpu()],
        "to('cpu')": [lambda: x.to("cpu"), lambda: x.to(device="cpu")],
        "repeat_interleave without output_size": [lambda: torch.arange(2).repeat_interleave(counts)],
        "boolean-mask index": [lambda: x[x > 2]],
        "masked_select": [lambda: x.masked_select(x > 2)],
    }
    for name, calls in cases.items():
        for call in calls:
            with SyncProbe() as probe:
                call()
            assert probe.calls == [name], (name, probe.calls)
    with SyncProbe() as probe:  # none of these reads a value on the host
        torch.arange(2).repeat_interleave(counts, output_size=3)
        torch.nonzero_static(x, size=3)
        x.to(torch.float64), x.to(torch.device("cpu"))  # this run's own device
        torch.sort(x)
    assert probe.calls == []
    assert torch.Tensor.tolist is not None and x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # restored


@pytest.mark.slow
def test_expert_parallel_syncs(tmp_path):
    """ep2 (tests/moe_sync_worker.py): with a padded capacity the exchange's sizes are static, one
    sync (the loss) with the grouped GEMM and with the loop; dropless, one copy of the exchange's
    sizes per MoE layer and micro-batch (2 x 2) besides."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(REPO / "tests" / "moe_sync_worker.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    counts = dict(re.findall(r"syncs (\w+) (\d+)", proc.stdout))
    assert counts == {"capacity_grouped": "1", "capacity_loop": "1", "dropless_grouped": "5"}, proc.stdout
