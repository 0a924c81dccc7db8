"""Count the collectives of one training iteration per rank, for several layouts in one launch.

    torchrun --nproc-per-node N tests/comm_counts.py LAYOUT[,LAYOUT...] --micro 1,2 --out counts.json
    torchrun --nproc-per-node 8 tests/comm_counts.py twin --config configs/gpt3_175b_twin.toml --out counts.json

Each layout's model is built in turn on the same process group through the library API and one
iteration counted per micro-batch count: any iteration's collectives are those of the first
(measured: the counts and bytes of the first and second were equal on every layout, an MoE's
all-to-all bytes summed over the ranks, as each rank's follow its routing), so one model serves
every count, except under a pipeline, whose schedule is built for its count and whose first
iteration also infers the stages' shapes: a pipeline is built per count and trains one uncounted
iteration, then is counted for one more. --micro counts micro-batches per rank, times pp under a
pipeline. Rank r writes {"counts": {layout: {micro: {kind: [count, bytes]}}}, "large_fp32":
{layout: {micro: [[op, elements], ...]}}} to OUT with '.r' appended: the second lists every fp32
collective of LARGE elements or more other than FSDP's gradient reduce-scatters.

The counter is a dispatch mode (CollectiveCount): every collective, whether FSDP's
`torch.distributed` calls, DTensor's functional collectives or the pipeline's send/recv, is one
dispatcher op on the calling thread, which the mode sees with its tensors. A collective op
nested inside another (a functional all-reduce runs the c10d one) runs below the mode, so it
counts once, as the outer. It counts the collectives, kind by kind, that torch's profiler (the
counter before it: the outermost collective ops of its trace) counted on dp2, tp2 + SP, pp2, cp2,
ep2, MLA tp2 + SP and bf16 tp2 + SP, and where tp, cp or ep run, the profiled iteration took 4.6
to 7.8 times as long as the counted one (the profiler recorded and read back ~10^4 ops per iteration).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    "ep2": {"expert_model_parallel_size": 2},
    "pp2_ep2": {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2},
    "ep2_tp2_sp": {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
    "ep2_full": {"expert_model_parallel_size": 2, "recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1},
    "tp2_sp_full": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "recompute_granularity": "full",
                    "recompute_method": "uniform", "recompute_num_layers": 1},
    "tp2_full2": {"tensor_model_parallel_size": 2, "recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 2},
    "tp2_sp_up_mlp_ln": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "recompute_granularity": "selective",
                         "recompute_modules": ["mla_up_proj", "mlp", "layernorm"]},
    "ep2_moe_act": {"expert_model_parallel_size": 2, "recompute_granularity": "selective", "recompute_modules": ["moe", "moe_act"]},
    "tp2_sp_moe_act": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "recompute_granularity": "selective",
                       "recompute_modules": ["moe", "moe_act"]},
}  # fmt: skip
RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")  # [training] keys in a layout
# No dropout: context parallelism refuses it under Megatron's RNG (and dropout communicates nothing).
MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
# A layout name may end in a precision ("tp2_sp_bf16", "tp2_sp_fp32"). Those runs use a wider model, whose every
# activation (b·s·h/tp under SP) has at least LARGE elements, so that the dtype census below sees
# each activation collective.
# "bf16r": bf16 with Megatron's --grad-reduce-in-bf16 (gradients accumulate and cross dp in bf16)
PRECISIONS = {"bf16": dict(bf16=True), "bf16r": dict(bf16=True, grad_reduce_in_bf16=True), "fp16": dict(fp16=True), "fp32": {}}
LOW_PRECISION_MODEL = {**MODEL, "hidden_size": 64, "seq_length": 32}
LARGE = 1024
# A layout name may start with "llama_": the Llama-style model (2 key/value groups for 4 heads, SwiGLU,
# RMSNorm, RoPE, qk-layernorm, no biases), whose qk-norms' gradients tp sums and whose key/value
# groups cp gathers. Its head stays tied here: with an untied head under FSDP the count has one
# all-gather of the embedding unit more than the formula (found by llama_cp2_tp2_sp, not yet mended).
LLAMA = "llama_"
LLAMA_MODEL = {**MODEL, "normalization": "RMSNorm", "swiglu": True, "ffn_hidden_size": 32, "add_bias_linear": False,
               "group_query_attention": True, "num_query_groups": 2, "position_embedding_type": "rope",
               "qk_layernorm": True}  # fmt: skip


MQA = "mqa_"
MQA_MODEL = {**LLAMA_MODEL, "num_query_groups": 1, "qk_layernorm": False}  # one group for both tp ranks


# A layout name may start with "moe_": Mixtral's structure in miniature (the Llama model with 4 SwiGLU experts
# in every block, top-2, the load-balancing loss), whose experts exchange tokens over ep.
MOE = "moe_"
MOE_MODEL = {**LLAMA_MODEL, "qk_layernorm": False, "num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
             "moe_grouped_gemm": True}  # fmt: skip


# A layout name may start with "mla_": DeepSeek-V3's attention in miniature (multi-latent attention with a
# compressed query and norms on the compressed vectors), whose narrow compressed vectors tp gathers.
MLA = "mla_"
MLA_MODEL = {**LLAMA_MODEL, "group_query_attention": False, "num_query_groups": 1, "multi_latent_attention": True,
             "q_lora_rank": 8, "kv_lora_rank": 8, "qk_head_dim": 4, "qk_pos_emb_head_dim": 2, "v_head_dim": 6,
             "rope_type": "rope"}  # fmt: skip


# A layout name may start with "mtp_": the tiny GPT with one multi-token prediction module (its FSDP root
# unit's share, its cp collectives: the block's and the shift's across chunks, the pipeline's embedding copy).
MTP = "mtp_"
MTP_MODEL = {**MODEL, "mtp_num_layers": 1, "position_embedding_type": "rope"}  # rope: pipelines need it
# "mtp_moe_": the MoE model with one prediction module, whose block is an MoE one (the last block's kind).
MTP_MOE = "mtp_moe_"
MTP_MOE_MODEL = {**MOE_MODEL, "mtp_num_layers": 1}


# "drop_": the tiny GPT with hidden dropout, whose mask keeps a recomputed group's last output collective in its replay;
# "shared_": the MoE model with a shared expert (a tensor-parallel MLP beside the routed experts).
DROP, SHARED = "drop_", "shared_"
DROP_MODEL = {**MODEL, "hidden_dropout": 0.1}
SHARED_MODEL = {**MOE_MODEL, "moe_shared_expert_intermediate_size": 16}


# A layout name may start with "muon_" (before the model's prefix): Megatron's --optimizer muon, whose
# optimizer step moves the matrices' update shards (dtgpt.plan.comm_muon).
MUON = "muon_"
MUON_OPTIMIZER = {"optimizer": "muon", "muon_nesterov": True}


def _model(name: str, precision: str | None) -> dict:
    name = name.removeprefix(MUON)
    for prefix, model in ((DROP, DROP_MODEL), (SHARED, SHARED_MODEL), (LLAMA, LLAMA_MODEL), (MQA, MQA_MODEL), (MOE, MOE_MODEL),
                          (MLA, MLA_MODEL), (MTP_MOE, MTP_MOE_MODEL), (MTP, MTP_MODEL)):  # fmt: skip
        if name.startswith(prefix):
            return model
    return MODEL if precision is None else LOW_PRECISION_MODEL


def split_name(name: str) -> tuple[str, str | None]:
    """("tp2_sp", "bf16") for "tp2_sp_bf16"; (name, None) without a precision suffix (and
    without a model prefix: "llama_", "mqa_", "moe_", ...)."""
    bare = name.removeprefix(MUON)
    for prefix in (DROP, SHARED, LLAMA, MQA, MOE, MLA, MTP_MOE, MTP):
        bare = bare.removeprefix(prefix)
    base, _, suffix = bare.rpartition("_")
    return (base, suffix) if suffix in PRECISIONS else (bare, None)


def layout_config(name: str, world_size: int, micro_per_rank: int):
    """The tiny GPT in layout `name` (fp32 unless it names a precision), with `micro_per_rank`
    micro-batches per dp rank."""
    base, precision = split_name(name)
    parallel = {k: v for k, v in LAYOUTS[base].items() if k not in RECOMPUTE_KEYS}
    recompute = {k: v for k, v in LAYOUTS[base].items() if k in RECOMPUTE_KEYS}
    model_parallel = [parallel.get(f"{k}_parallel_size", 1) for k in ("tensor_model", "pipeline_model", "context")]
    dp = world_size // (model_parallel[0] * model_parallel[1] * model_parallel[2])
    return dtgpt.make_config(
        model=_model(name, precision),
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100),
        training=dict(micro_batch_size=1, global_batch_size=dp * micro_per_rank, **PRECISIONS.get(precision, {}), **recompute),
        parallel=parallel,
        optimizer=MUON_OPTIMIZER if name.startswith(MUON) else {},
    )

# op name -> (kind, which argument holds the full message: a tensor or a list of tensors)
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
    "c10d::alltoall_base_": ("all_to_all", 1),  # (output, input, ...): the dispatcher's token counts
}
COMM_PREFIXES = ("c10d::", "_c10d_functional::")
NOT_COLLECTIVES = {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd", "c10d::monitored_barrier_"}
# Gradient reductions run c10d's own ops: FSDP's reduce-scatter, HSDP's and the split tied
# embedding's all-reduce (dtgpt's other c10d all-reduces, of the loss, norm and flags, are
# scalars); every activation collective of TP, SP and CP is a functional one (DTensor's).
GRADIENT_REDUCTIONS = {"c10d::_reduce_scatter_base_", "c10d::allreduce_"}


def message(name: str, args: tuple) -> tuple[int, torch.dtype, int]:
    """(elements, dtype, bytes) of one collective's message."""
    held = args[OPS[name][1]]
    tensors = list(held) if isinstance(held, (list, tuple)) else [held]
    numel = sum(t.numel() for t in tensors)
    if name == "_c10d_functional::all_gather_into_tensor":
        numel *= int(args[1])  # group_size
    return numel, tensors[0].dtype, numel * tensors[0].element_size()


class CollectiveCount(TorchDispatchMode):
    """Every collective a rank issues while active: {kind: [count, bytes]}, and the fp32 ones of
    LARGE elements or more other than gradient reductions ([op, elements] each)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.large_fp32: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().replace(".default", "")
        if name.startswith(COMM_PREFIXES) and name not in NOT_COLLECTIVES:
            if name not in OPS:
                raise ValueError(f"uncounted collective op {name}: add it to OPS")
            numel, dtype, size = message(name, args)
            count = self.counts[OPS[name][0]]
            count[0], count[1] = count[0] + 1, count[1] + size
            if dtype == torch.float32 and numel >= LARGE and name not in GRADIENT_REDUCTIONS:
                self.large_fp32.append([name, numel])
        return func(*args, **(kwargs or {}))


def count_iteration(cfg, state, batch) -> tuple[dict[str, list[int]], list]:
    with CollectiveCount() as seen:
        dtgpt.train_step(cfg, state, batch)
    return dict(seen.counts), seen.large_fp32


def rank_batch(cfg, model, n_micro: int, vocab: int) -> torch.Tensor | None:
    if not model.reads_batches:
        return None
    gen = torch.Generator().manual_seed(model.dims.dp_rank)
    rows = cfg.training.micro_batch_size * n_micro
    return torch.randint(0, vocab, (rows, cfg.model.seq_length + 1), generator=gen)


def count_layout(cfg, runtime, n_micro: int, vocab: int) -> tuple[dict[str, list[int]], list]:
    """Build cfg's model on the runtime's ranks and count its first iteration (a pipeline's
    second: its first infers the stages' shapes); cfg's global batch makes n_micro micro-batches
    per data-parallel rank."""
    model = dtgpt.build_model(cfg, runtime, vocab_size=vocab)
    state = dtgpt.build_train_state(cfg, model)
    batch = rank_batch(cfg, model, n_micro, vocab)
    if model.dims.pp > 1:
        dtgpt.train_step(cfg, state, batch)
    return count_iteration(cfg, state, batch)


def count_micro_counts(cfgs: list, runtime, n_micros: list[int], vocab: int) -> list[tuple[dict[str, list[int]], list]]:
    """count_layout of one layout's configs, which differ only in their global batch (cfgs[i]
    makes n_micros[i] micro-batches per data-parallel rank). Without a pipeline one model counts
    them all, an iteration each (module doc): a build less per count. A pipeline's schedule is
    built for its count: a model each."""
    if cfgs[0].parallel.pipeline_model_parallel_size > 1:
        return [count_layout(cfg, runtime, n, vocab) for cfg, n in zip(cfgs, n_micros)]
    model = dtgpt.build_model(cfgs[0], runtime, vocab_size=vocab)
    state = dtgpt.build_train_state(cfgs[0], model)
    return [count_iteration(cfg, state, rank_batch(cfg, model, n, vocab)) for cfg, n in zip(cfgs, n_micros)]


def count_config_file(path: str, overrides: list[str]) -> tuple:
    """One config file's layout at its final global batch size (from the first iteration on:
    train_step takes its batch size from the ramp-up, which is dropped here)."""
    cfg = load_config(path, overrides)
    cfg.training.rampup_batch_size = []
    runtime = dtgpt.init_distributed(cfg)
    n_micro = num_microbatches(cfg, runtime.dims.dp, cfg.training.global_batch_size)
    vocab = padded_vocabulary(cfg, build_tokenizer(cfg.data).vocab_size)
    return runtime, n_micro, count_layout(cfg, runtime, n_micro, vocab)


def micro_counts(name: str, spec: str) -> list[int]:
    """The micro-batch counts asked for, per pipeline stage: a schedule needs at least pp of them."""
    pp = LAYOUTS[split_name(name)[0]].get("pipeline_model_parallel_size", 1)
    return [int(m) * pp for m in spec.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layouts")
    parser.add_argument("--micro", default="1,2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", help="count this config file's layout instead; the positional argument names it")
    args, overrides = parser.parse_known_args()
    world = int(os.environ["WORLD_SIZE"])
    result: dict[str, dict] = {"counts": defaultdict(dict), "large_fp32": defaultdict(dict)}
    if args.config:
        runtime, n, (counts, large) = count_config_file(args.config, overrides)
        result["counts"][args.layouts][n], result["large_fp32"][args.layouts][n] = counts, large
    else:
        names = args.layouts.split(",")
        runtime = dtgpt.init_distributed(layout_config(names[0], world, 1))
        for name in names:
            micros = micro_counts(name, args.micro)
            cfgs = [layout_config(name, world, n) for n in micros]
            for n, (counts, large) in zip(micros, count_micro_counts(cfgs, runtime, micros, 100)):
                result["counts"][name][n], result["large_fp32"][name][n] = counts, large
    with open(f"{args.out}.{runtime.rank}", "w") as f:
        json.dump(result, f)
    dtgpt.shutdown()


if __name__ == "__main__":
    main()
