"""The split tied embedding under the library API, for tests/test_tied.py: torchrun, 2 ranks (pp2).

Trains 3 iterations with dtgpt.forward_backward and a plain SGD (the library API must sum the
two copies' gradients itself), checks the copies, then perturbs the last stage's copy and
prints what the check says.
"""

import torch
import torch.distributed as dist

import dtgpt

cfg = dtgpt.make_config(
    model=dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0),
    data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=64, num_workers=0),
    training=dict(micro_batch_size=2, global_batch_size=4, train_iters=3),
    parallel=dict(pipeline_model_parallel_size=2, pipeline_schedule="1F1B"),
)
runtime = dtgpt.init_distributed(cfg)
model = dtgpt.build_model(cfg, runtime, vocab_size=64)
batches = dtgpt.build_train_iterator(cfg, model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for iteration in range(1, 4):
    optimizer.zero_grad()
    dtgpt.forward_backward(model, next(batches), dtgpt.num_microbatches(cfg, model.dims.dp))
    optimizer.step()
model.check_tied_copies(3)
print(f"rank {dist.get_rank()}: copies equal after 3 steps", flush=True)
if dist.get_rank() == 1:
    with torch.no_grad():
        model.parts[0].output.weight[0, 0] += 1e-3
try:
    model.check_tied_copies(4)
except RuntimeError as e:
    print(f"rank {dist.get_rank()}: {e}", flush=True)
dtgpt.shutdown()
