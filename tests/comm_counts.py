"""Count the collectives of one training iteration per rank, for several layouts in one launch.

    torchrun --nproc-per-node N tests/comm_counts.py LAYOUT[,LAYOUT...] --micro 1,4 --out counts.json
    torchrun --nproc-per-node 8 tests/comm_counts.py twin --config configs/gpt3_175b_twin.toml --out counts.json

Each layout's model is built in turn on the same process group through the library API, trained
for one untimed iteration (pipeline stages infer their shapes on the first), then profiled for
one more. Rank r writes {layout: {micro: {kind: [count, bytes]}}} to OUT with '.r' appended.

The profiler is the counter because it is exact on gloo: every collective, whether FSDP's
`torch.distributed` calls, DTensor's functional collectives or the pipeline's send/recv, is one
dispatcher op on the calling thread with its tensor shapes and dtype recorded. A collective op
nested inside another (a functional all-reduce runs the c10d one) counts once, as the outer.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import dtgpt
from dtgpt.config import load_config, num_microbatches, padded_vocabulary
from dtgpt.data.tokenizer import build_tokenizer

# The layouts the count tests cover: name -> [parallel] keys (dp_shard takes the rest).
LAYOUTS = {
    "dp2": {},
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2_1f1b": {"pipeline_model_parallel_size": 2},
    "pp2_interleaved": {"pipeline_model_parallel_size": 2, "pipeline_schedule": "Interleaved1F1B",
                        "virtual_pipeline_stages_per_rank": 2},
    "dp2_zero3": {"fsdp_reshard_after_forward": "always"},
    "hsdp2x2": {"data_parallel_replicate_size": 2},
    "pp2_dp2": {"pipeline_model_parallel_size": 2},
    "dp2_tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2_tp2_sp": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
    "dp2_tp2": {"tensor_model_parallel_size": 2},
    "pp2_tp2": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2},
    "cp2": {"context_parallel_size": 2},
    "cp2_tp2_sp": {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
}  # fmt: skip
# No dropout: context parallelism refuses it under Megatron's RNG (and dropout communicates nothing).
MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)


def layout_config(name: str, world_size: int, micro_per_rank: int):
    """The tiny fp32 GPT in layout `name`, with `micro_per_rank` micro-batches per dp rank."""
    parallel = LAYOUTS[name]
    model_parallel = [parallel.get(f"{k}_parallel_size", 1) for k in ("tensor_model", "pipeline_model", "context")]
    dp = world_size // (model_parallel[0] * model_parallel[1] * model_parallel[2])
    return dtgpt.make_config(
        model=MODEL,
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100),
        training=dict(micro_batch_size=1, global_batch_size=dp * micro_per_rank),
        parallel=parallel,
    )

# op name -> (kind, which recorded input holds the full message)
OPS = {
    "c10d::_allgather_base_": ("all_gather", 0),  # (output, input): output is the gathered tensor
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),  # (output, input): input is the full tensor
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::send": ("send", 0),
    "c10d::recv_": ("recv", 0),
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_reduce_": ("all_reduce", 0),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0),  # input is the shard: x group size
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
}
OTHER_COMM_PREFIXES = ("c10d::", "_c10d_functional::")
NOT_COLLECTIVES = {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd", "c10d::monitored_barrier_"}
DTYPE_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "long int": 8, "int": 4}


def _numel(dims) -> int:
    if dims and isinstance(dims[0], list):  # a TensorList: sum over its tensors
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        n *= d
    return n


def _message_bytes(name: str, args: dict) -> int:
    index = OPS[name][1]
    dims, dtype = args["Input Dims"][index], args["Input type"][index]
    # The profiler records no dtype for a tensor list (c10d's all_reduce, send, recv): dtgpt's
    # all-reduces are of fp32 (loss, norm, flags, tied gradients), and pipeline sends carry the
    # residual stream, fp32 under autocast at any precision (dtgpt/parallel/fsdp.py).
    nbytes = _numel(dims) * DTYPE_BYTES.get(dtype, 4)
    if name == "_c10d_functional::all_gather_into_tensor":
        nbytes *= int(args["Concrete Inputs"][1])  # group_size
    return nbytes


def count_trace(trace: dict) -> dict[str, list[int]]:
    """{kind: [count, bytes]} of the outermost collective ops in one rank's chrome trace."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name", "").startswith(OTHER_COMM_PREFIXES)
              and e["name"] not in NOT_COLLECTIVES]  # fmt: skip
    events.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    open_until: dict = {}
    for e in events:
        if e["ts"] < open_until.get(e["tid"], -1):
            continue  # nested inside a collective already counted
        open_until[e["tid"]] = e["ts"] + e["dur"]
        name = e["name"]
        if name not in OPS:
            raise ValueError(f"uncounted collective op {name}: add it to OPS")
        args = e["args"]
        counts[OPS[name][0]][0] += 1
        counts[OPS[name][0]][1] += _message_bytes(name, args)
    return dict(counts)


def profile_iteration(cfg, state, batch) -> dict[str, list[int]]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dtgpt.train_step(cfg, state, batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return count_trace(json.load(f))


def rank_batch(cfg, model, n_micro: int, vocab: int) -> torch.Tensor | None:
    if not model.reads_batches:
        return None
    gen = torch.Generator().manual_seed(model.dims.dp_rank)
    rows = cfg.training.micro_batch_size * n_micro
    return torch.randint(0, vocab, (rows, cfg.model.seq_length + 1), generator=gen)


def count_layout(cfg, runtime, n_micro: int, vocab: int) -> dict[str, list[int]]:
    """Build cfg's model on the runtime's ranks, train one iteration, count the next (cfg's global
    batch makes n_micro micro-batches per data-parallel rank)."""
    model = dtgpt.build_model(cfg, runtime, vocab_size=vocab)
    state = dtgpt.build_train_state(cfg, model)
    batch = rank_batch(cfg, model, n_micro, vocab)
    dtgpt.train_step(cfg, state, batch)
    return profile_iteration(cfg, state, batch)


def count_config_file(path: str, overrides: list[str]) -> tuple:
    """One config file's layout at its final global batch size (from the first iteration on:
    train_step takes its batch size from the ramp-up, which is dropped here)."""
    cfg = load_config(path, overrides)
    cfg.training.rampup_batch_size = []
    runtime = dtgpt.init_distributed(cfg)
    n_micro = num_microbatches(cfg, runtime.dims.dp, cfg.training.global_batch_size)
    vocab = padded_vocabulary(cfg, build_tokenizer(cfg.data).vocab_size)
    return runtime, {n_micro: count_layout(cfg, runtime, n_micro, vocab)}


def micro_counts(name: str, spec: str) -> list[int]:
    """The micro-batch counts asked for; a pipeline schedule needs at least pp of them."""
    pp = LAYOUTS[name].get("pipeline_model_parallel_size", 1)
    return [max(int(m), pp) for m in spec.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layouts")
    parser.add_argument("--micro", default="1,4")
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", help="count this config file's layout instead; the positional argument names it")
    args, overrides = parser.parse_known_args()
    world = int(os.environ["WORLD_SIZE"])
    if args.config:
        runtime, counts = count_config_file(args.config, overrides)
        result = {args.layouts: counts}
    else:
        names = args.layouts.split(",")
        runtime = dtgpt.init_distributed(layout_config(names[0], world, 1))
        result = {
            name: {n: count_layout(layout_config(name, world, n), runtime, n, 100) for n in micro_counts(name, args.micro)}
            for name in names
        }
    with open(f"{args.out}.{runtime.rank}", "w") as f:
        json.dump(result, f)
    dtgpt.shutdown()


if __name__ == "__main__":
    main()
