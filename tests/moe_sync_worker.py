"""Host syncs per forward_backward of an MoE GPT at ep2, for tests/test_moe_sync.py (torchrun, 2 gloo ranks).

    torchrun --nproc-per-node 2 tests/moe_sync_worker.py

For each case (padded capacity with the grouped GEMM and with the loop; dropless), rank 0 prints
one line `syncs CASE N: name, name, ...` counted by tests/sync_probe.py over the second of two
forward_backward calls (2 layers, 2 micro-batches).
"""

from __future__ import annotations

import torch

import dtgpt
from tests.sync_probe import SyncProbe
from tests.test_moe_sync import MODEL, MOE, VOCAB

CAPACITY = dict(MOE, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
CASES = {"capacity_grouped": dict(CAPACITY, moe_grouped_gemm=True), "capacity_loop": CAPACITY,
         "dropless_grouped": dict(MOE, moe_grouped_gemm=True)}  # fmt: skip
MICRO = 2


def config(model: dict):
    return dtgpt.make_config(
        model=dict(MODEL, num_layers=2, **model),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        training=dict(micro_batch_size=1, global_batch_size=2 * MICRO, train_iters=1),
        parallel=dict(expert_model_parallel_size=2),
    )


def main() -> None:
    runtime = dtgpt.init_distributed(config(CASES["capacity_grouped"]))
    for name, model in CASES.items():
        parts = dtgpt.build_model(config(model), runtime, vocab_size=VOCAB)
        gen = torch.Generator().manual_seed(runtime.rank)
        batch = torch.randint(0, VOCAB, (MICRO, MODEL["seq_length"] + 1), generator=gen)
        dtgpt.forward_backward(parts, batch, MICRO)
        with SyncProbe() as probe:
            dtgpt.forward_backward(parts, batch, MICRO)
        if runtime.is_main:
            print(f"syncs {name} {probe.count}: {', '.join(probe.calls)}", flush=True)
    dtgpt.shutdown()


if __name__ == "__main__":
    main()
