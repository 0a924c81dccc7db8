"""Document attention through the varlen kernel on pipeline stages, for
tests/test_attention_varlen.py: torchrun, 2 ranks (pp2) or 4 (pp2 x cp2).

    torchrun --nproc-per-node 2 tests/varlen_pp_worker.py OUT    (and 4: pp2 x cp2)

With a CPU reference standing in for the kernel (tests/test_attention_varlen.py's, counting its
calls), trains each layout of LAYOUTS[world size] for ITERATIONS iterations on mock data with Megatron's
reset options, and rank r writes OUT/rank<r>.pt: per layout the losses, the gradient norms, the
kernel's calls on this rank and this rank's parameters by name. `train` is what one process runs
too (the test, on the same data).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests`, when run as a script

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import dtgpt  # noqa: E402
from dtgpt import varlen_kernel  # noqa: E402

ITERATIONS, MICRO_BATCHES, LAYERS = 2, 4, 4
LAYOUTS = {  # by world size
    2: {
        "pp2_1f1b": dict(pipeline_model_parallel_size=2, pipeline_schedule="1F1B"),
        "pp2_interleaved": dict(pipeline_model_parallel_size=2, pipeline_schedule="Interleaved1F1B",
                                virtual_pipeline_stages_per_rank=2),
    },
    # each cp rank's chunks through the kernel against the whole sequences' bounds
    4: {"pp2_cp2": dict(pipeline_model_parallel_size=2, context_parallel_size=2, pipeline_schedule="1F1B")},
}  # fmt: skip


def config(parallel: dict | None = None):
    return dtgpt.make_config(
        model=dict(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                   attention_dropout=0.0, make_vocab_size_divisible_by=64, untie_embeddings_and_output_weights=True),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=64, num_workers=0,
                  eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True),
        training=dict(micro_batch_size=1, global_batch_size=MICRO_BATCHES, train_iters=ITERATIONS),
        optimizer=dict(lr=3e-3, lr_warmup_iters=0),
        parallel=parallel or {},
    )  # fmt: skip


def train(cfg, runtime) -> dict:
    """ITERATIONS training steps: losses, gradient norms and this rank's final parameters."""
    state = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, vocab_size=64))
    batches = dtgpt.build_train_iterator(cfg, state.model)
    steps = [dtgpt.train_step(cfg, state, next(batches)) for _ in range(ITERATIONS)]
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in state.model.named_parameters()}
    return {"losses": [s.loss for s in steps], "grad_norms": [s.grad_norm for s in steps], "params": params,
            "layers_here": sum(len(part.layers) for part in state.model.parts)}  # fmt: skip


def main(out: Path) -> None:
    from tests.test_attention_varlen import reference_kernel

    calls = []

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return reference_kernel(q, *args, **kwargs)

    varlen_kernel.kernel_for = lambda q: counting
    layouts = LAYOUTS[int(os.environ["WORLD_SIZE"])]
    runtime = dtgpt.init_distributed(config(next(iter(layouts.values()))))
    results = {}
    for name, parallel in layouts.items():
        calls.clear()
        results[name] = {**train(config(parallel), runtime), "calls": len(calls)}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dtgpt.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
