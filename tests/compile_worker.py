"""Train a tiny GPT for a few iterations in several layouts in one launch; save losses and gradients.

    torchrun --nproc-per-node N tests/compile_worker.py LAYOUT[,LAYOUT...] --out DIR   # compiled
    python tests/compile_worker.py single --eager --out DIR                            # the reference

Each layout is built in turn on the same process group through the library API (a layout other
than the first gets its own mesh), so the compilers' start-up is paid once per launch. Every
iteration trains on the same global batch whatever the mesh (each data-parallel rank takes its
rows); after each step the gradients (tied ones summed, clipped) are gathered whole by name, and
after the last the parameters; then one evaluation. Rank 0 writes DIR/LAYOUT.pt: {"losses":
[...], "grad_norms": [...], "grads": [{name: tensor}, ...], "params": {name: tensor},
"eval_loss": float}.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtgpt
from dtgpt.parallel.rng import stage_seed

TP2 = {"tensor_model_parallel_size": 2}
SP = {"sequence_parallel": True}
LAYOUTS = {
    "single": {},
    "tp2_sp": {**TP2, **SP},
    "pp2": {"pipeline_model_parallel_size": 2},
    "pp2_tp2_sp": {"pipeline_model_parallel_size": 2, **TP2, **SP},
    "dp2_tp2_sp": {"data_parallel_shard_size": 2, **TP2, **SP},
    "dp2_tp2": {"data_parallel_shard_size": 2, **TP2},
    "pp2_dp2": {"pipeline_model_parallel_size": 2, "data_parallel_shard_size": 2},
    "dp2": {"data_parallel_shard_size": 2},
    # Dropout 0.1 under tp, Megatron's streams: compiled, and its reference, eager on the same mesh
    # (a name ending in "_eager" runs eager in a compiled launch).
    "tp2_dropout": TP2,
    "tp2_dropout_eager": TP2,
}  # fmt: skip
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
# A layout name may start with "moe_": every block an MoE layer (4 looped experts, top-2, both router losses).
MOE = "moe_"
MOE_MODEL = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
             attention_dropout=0.0, make_vocab_size_divisible_by=64)  # fmt: skip
VOCAB = 128
GLOBAL_BATCH = 4
ITERATIONS = 3
LR = 1e-2


def layout_config(name: str, compile: bool):
    moe = name.startswith(MOE)
    return dtgpt.make_config(
        model={**MODEL, **(MOE_MODEL if moe else {}), **(DROPOUT if "dropout" in name else {})},
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        training=dict(micro_batch_size=1, global_batch_size=GLOBAL_BATCH, train_iters=ITERATIONS,
                      compile=compile and not name.endswith("_eager")),
        optimizer=dict(lr=LR, lr_decay_style="constant"),
        parallel=LAYOUTS[name.removeprefix(MOE)],
    )


def rank_batch(model, iteration: int) -> torch.Tensor | None:
    """This data-parallel rank's rows of global batch `iteration` (None where no stage reads it)."""
    if not model.reads_batches:
        return None
    gen = torch.Generator().manual_seed(iteration)
    rows = torch.randint(0, VOCAB, (GLOBAL_BATCH, MODEL["seq_length"] + 1), generator=gen)
    return rows.chunk(model.dims.dp)[model.dims.dp_rank]


def full_tensors(model, of) -> dict[str, torch.Tensor]:
    """name -> the whole tensor of(parameter) (a gradient, the parameter itself), from every rank."""
    tensors = {}
    for part in model.parts:
        for name, p in part.named_parameters():
            if (t := of(p)) is not None:
                tensors[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, tensors)
        tensors = {k: v for rank_tensors in per_rank for k, v in rank_tensors.items()}  # each stage's own
    return tensors


def train_layout(name: str, compile: bool, runtime) -> dict:
    # Each layout compiles from a clean slate, as in a process of its own: compiling tp2 blocks in
    # a process that compiled tp2+SP blocks before failed in torch 2.13 (RecursionError while
    # tracing the backward), a case train.py, one layout per process, never meets.
    torch._dynamo.reset()
    cfg = layout_config(name, compile)
    model = dtgpt.build_model(cfg, runtime, vocab_size=VOCAB)
    state = dtgpt.build_train_state(cfg, model)
    torch.manual_seed(stage_seed(cfg.training.seed, model.dims.pp_rank))  # dropout: every layout from the start's stream
    n_micro = dtgpt.num_microbatches(cfg, model.dims.dp)
    record: dict = {"losses": [], "grad_norms": [], "grads": []}
    for iteration in range(ITERATIONS):
        batch = rank_batch(model, iteration)
        result = dtgpt.train_step(cfg, state, batch)
        record["losses"].append(result.loss)
        record["grad_norms"].append(result.grad_norm)
        record["grads"].append(full_tensors(model, lambda p: p.grad))
    record["params"] = full_tensors(model, lambda p: p)
    # An evaluation (eval mode, no grad) recompiles the blocks: the loss of one more batch.
    model.train(False)
    record["eval_loss"] = dtgpt.forward_backward(model, rank_batch(model, ITERATIONS), n_micro, forward_only=True)
    model.train(True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layouts")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    names = args.layouts.split(",")
    runtime = dtgpt.init_distributed(layout_config(names[0], not args.eager))
    for name in names:
        record = train_layout(name, not args.eager, runtime)
        if runtime.is_main:
            torch.save(record, os.path.join(args.out, f"{name}.pt"))
    dtgpt.shutdown()


if __name__ == "__main__":
    main()
