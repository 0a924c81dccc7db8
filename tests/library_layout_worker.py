"""Models of other layouts than the runtime's, under the library API, for tests/test_library.py.

torchrun, 2 ranks: the runtime is started from a dp2 (tp1) config; a tp2 model and a pp2 model
are built from their own configs (each gets a mesh of its own over the same two ranks) and train
3 iterations, reading their batches through their own mesh, then evaluate 2 validation batches.
Each rank writes one `result_<layout>_<rank>.json` per layout in the working directory (a file,
not stdout: two ranks' lines can interleave there): the token sums of the batches it read, the
losses and the validation loss. Then the runtime itself is offered as the reader, and refused.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

import dtgpt
from dtgpt.data import build_datasets, build_tokenizer
from dtgpt.data.batch import TokenOptions

MODEL = dict(num_layers=2, hidden_size=12, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=4)  # fmt: skip
DATA = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100, num_workers=0, eod_mask_loss=True)
TRAINING = dict(micro_batch_size=2, global_batch_size=8, train_iters=3)
EVAL = dict(eval_iters=2, eval_interval=3)
LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2, pipeline_schedule="1F1B")}


def run(cfg, runtime) -> dict:
    """3 iterations of forward-backward with Adam, then the loss of 2 validation batches."""
    model = dtgpt.build_model(cfg, runtime, vocab_size=100)
    tokenizer = build_tokenizer(cfg.data)
    datasets = build_datasets(cfg, tokenizer, dtgpt.num_samples_needed(cfg))
    options = TokenOptions.from_config(cfg.data, tokenizer.eod)
    batches, valid, _ = dtgpt.build_data_iterators(cfg, model, datasets, options)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    sums, losses = [], []
    for _ in range(3):
        batch = next(batches)
        sums.append(int(batch.tokens.sum()))
        optimizer.zero_grad()
        losses.append(dtgpt.forward_backward(model, batch, dtgpt.num_microbatches(cfg, model.dims.dp)))
        optimizer.step()
    return {"batches": sums, "losses": losses, "eval": dtgpt.evaluate(cfg, model, valid, 2)}


def main():
    runtime = dtgpt.init_distributed(dtgpt.make_config(model=MODEL, data=DATA, training=TRAINING, eval=EVAL))
    for name, parallel in LAYOUTS.items():
        cfg = dtgpt.make_config(model=MODEL, data=DATA, training=TRAINING, eval=EVAL, parallel=parallel)
        result = {"rank": dist.get_rank(), "layout": name, **run(cfg, runtime)}
        Path(f"result_{name}_{dist.get_rank()}.json").write_text(json.dumps(result))
    try:
        dtgpt.build_train_iterator(cfg, runtime)
    except TypeError as e:
        print(f"rank {dist.get_rank()} refused the runtime: {e}", flush=True)
    dtgpt.shutdown()


if __name__ == "__main__":
    main()
