"""Megatron Core's simple training loop, on dtgpt's library API (CPU: gloo; GPUs: NCCL).

    torchrun --nproc-per-node 2 examples/simple_train_loop.py [checkpoint_dir]

Tensor parallel 2, a 2-layer GPT (hidden 12, 4 heads, vocab 100, seq 64) on mock data, 5
iterations of forward-backward with Adam, a distributed checkpoint, and that checkpoint loaded
into the same model built at tensor parallel 1 (here: FSDP over both ranks) with equal weights.
"""

import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

import dtgpt

MODEL = dict(num_layers=2, hidden_size=12, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=4)  # fmt: skip
DATA = dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100, num_workers=0)
TRAINING = dict(micro_batch_size=2, global_batch_size=8, train_iters=5)


def shared_directory() -> str:
    """A checkpoint directory every rank agrees on (rank 0 makes a temporary one if none is given)."""
    box = [sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dtgpt_simple_")]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def full_weights(model) -> dict:
    """Every parameter gathered whole, whatever the mesh shards it over."""
    gather = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # noqa: E731
    return {name: gather(p) for name, p in model.named_parameters()}


def main():
    cfg = dtgpt.make_config(model=MODEL, data=DATA, training=TRAINING, parallel=dict(tensor_model_parallel_size=2))
    runtime = dtgpt.init_distributed(cfg)  # TP 2 x PP 1
    model = dtgpt.build_model(cfg, runtime, vocab_size=100)
    batches = dtgpt.build_train_iterator(cfg, model)  # the batches this model reads
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for iteration in range(1, 6):
        optimizer.zero_grad()
        loss = dtgpt.forward_backward(model, next(batches), dtgpt.num_microbatches(cfg, model.dims.dp))
        optimizer.step()
        if runtime.is_main:
            print(f"iteration {iteration}: loss {loss:.6f}", flush=True)

    directory = shared_directory()
    dtgpt.save_checkpoint(directory, cfg, runtime, model, optimizer, iteration=5)

    cfg_tp1 = dtgpt.make_config(model=MODEL, data=DATA, training=TRAINING)
    fresh = dtgpt.build_model(cfg_tp1, runtime, vocab_size=100)
    dtgpt.load_checkpoint(directory, cfg_tp1, runtime, fresh)
    saved, loaded = full_weights(model), full_weights(fresh)
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[name], loaded[name]) for name in saved), "weights differ after loading"
    if runtime.is_main:
        print(f"loaded the TP 2 checkpoint from {directory} into a TP 1 model: all {len(saved)} tensors equal", flush=True)
    if dist.is_initialized():
        dist.barrier()  # every rank has read the checkpoint before it goes
    if runtime.is_main and len(sys.argv) == 1:
        shutil.rmtree(directory)
    dtgpt.shutdown(dims=runtime.dims)


if __name__ == "__main__":
    main()
