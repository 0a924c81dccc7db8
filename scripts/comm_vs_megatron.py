"""Bytes one rank sends per iteration, by collective class: dtgpt against Megatron-LM's analytic figure.

    python scripts/comm_vs_megatron.py --config configs/gpt3_175b.toml
    python scripts/comm_vs_megatron.py --config configs/gpt3_175b_twin.toml --world-size 8

dtgpt's side is dtgpt.plan.comm, the formula tests/test_comm_counts.py holds equal to the
collectives a profiler counts on real ranks. Megatron's side is written here from how Megatron-LM
runs the same config (fp16/bf16 model, distributed optimizer, SP as configured):

  TP   per sub-layer and micro-batch, with SP: all-gather of the norm output and reduce-scatter
       of the row-parallel output forward; backward, the all-gather of the output gradient, the
       reduce-scatter of the input gradient, and the input all-gathered again for the weight
       gradient (the column-parallel layer keeps only its sequence shard): 3 all-gathers and
       2 reduce-scatters of b·s·h·e. Without SP: 1 all-reduce each way. Full recomputation
       replays a recomputed block's whole forward (its checkpoint has no early stop): 2 all-gathers
       and 2 reduce-scatters (without SP 2 all-reduces) more per block and micro-batch. The embedding reduce-
       scatters (SP) or all-reduces its output; the output layer gathers its input (SP, and again
       in backward) or all-reduces its input gradient; the vocabulary-parallel loss all-reduces
       3 x b·s fp32. With SP the norm weights' gradients: 1 all-reduce of h·g per norm tensor;
       with qk-layernorm (any tp) 1 of head_dim·g per qk-norm tensor.
  PP   1 send and 1 recv of b·(s/tp under SP)·h·e per micro-batch and stage boundary, each way.
  DP   the distributed optimizer: 1 reduce-scatter of the gradients (g bytes) and 1 all-gather
       of the parameters (e bytes) per iteration.
  EP   (MoE, the alltoall dispatcher) per MoE layer and micro-batch: the routed rows, R·h·e,
       dispatched and combined forward and both again backward (a MoE layer recomputed, fully or
       with selective 'moe', dispatches and combines again), the prediction modules' MoE layers
       too, and the tokens per expert all-gathered over ep (ep·E int64). The distributed
       optimizer shards the experts over the expert data-parallel ranks (dp·cp/ep) and the rest
       over dp·cp. Under tp Megatron folds the tp ranks into the experts' data-parallel group:
       that layout is not compared here (tp 1 only for MoE).
  Muon (--optimizer muon with its distributed optimizer, dist_muon: megatron-core's layer-wise
       optimizer) DP: plain DDP's all-reduce of the gradients (g bytes), each rank updating the
       whole parameters it owns, then 1 all-gather of the updated parameters (e bytes); TP
       ('duplicated'): 1 all-gather per tp-sharded matrix of its whole fp32 update (QKV's three
       parts under muon_split_qkv, the same bytes), on every rank. dtgpt's all_to_alls of the
       matrices' rows to their owner and back count with the dp gradient reductions (both are
       how a gradient reaches the rank that updates it), its owner's all-gather over tp with
       Megatron's tp gathers.
  tied the embedding gradient, all-reduced between the first and last stage (g bytes).
  scalars  the gradient norm (1 fp32), the loss and its token count (2 fp32 over dp), the fp16
       overflow flag (1 fp32).

Bytes are what one rank sends in a ring (dtgpt.plan.links.link_bytes), for the pp rank given
(default: each pp rank's worst class is shown, as rows per pp rank).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtgpt.cli import print_error  # noqa: E402
from dtgpt.config import ConfigError, load_config, num_microbatches, padded_vocabulary  # noqa: E402
from dtgpt.plan.comm import (  # noqa: E402
    FP32,
    Collective,
    CommLayout,
    block_shapes,
    embedding_shapes,
    head_shapes,
    rank_collectives,
    rank_stages,
)
from dtgpt.chunks import padded_numel  # noqa: E402
from dtgpt.plan import comm_muon  # noqa: E402
from dtgpt.plan.comm_recompute import recomputed_blocks, rerun_moe_layers  # noqa: E402
from dtgpt.plan.comm_moe import expert_shapes, is_moe_block, moe_layers_held, routed_rows, stage_blocks  # noqa: E402
from dtgpt.plan.layout import tokenizer_vocab_size  # noqa: E402
from dtgpt.plan.links import group_size, link_bytes  # noqa: E402

CLASSES = ("tp activations", "tp norm-weight grads", "tp loss", "pp activations", "dp param gathers",
           "dp grad reductions", "tied embedding grads", "ep all-to-all", "tp muon gathers", "scalars")  # fmt: skip


def collective_class(col: Collective) -> str:
    """The class of one of dtgpt's (or the Megatron model's) collectives."""
    if col.what.startswith("muon"):
        return "tp muon gathers" if col.dim == "tp" else "dp grad reductions"
    if col.dim == "tp":
        if "norm weight" in col.what:
            return "tp norm-weight grads"
        return "tp loss" if "loss" in col.what else "tp activations"
    if col.dim == "pp" and col.kind in ("send", "recv"):
        return "pp activations"
    if col.what.startswith(("fsdp", "hsdp", "dp ")):
        return "dp param gathers" if col.kind == "all_gather" else "dp grad reductions"
    if col.dim == "tied":
        return "tied embedding grads"
    if col.dim == "ep":
        return "ep all-to-all"
    return "scalars"


def megatron_collectives(c: CommLayout, pp_rank: int, n: int) -> list[Collective]:
    """Every collective Megatron-LM's rank at pp_rank runs per iteration (the module doc)."""
    stages = rank_stages(c, pp_rank)
    first, last = 0 in stages, c.num_stages - 1 in stages
    blocks = sum(c.layer_counts[s] for s in stages)
    e, g = c.compute_bytes, c.grad_bytes
    act = c.micro_batch * c.tokens * c.hidden * e
    sub = 2 * blocks * n
    replayed = sum(len(recomputed_blocks(c, s)) for s in stages) * n  # full recomputation replays each such block's whole forward
    out = []
    if c.tp > 1:
        if c.sequence_parallel:
            out += [Collective("all_gather", "tp", "sp activations", 3 * sub + 2 * replayed, act),
                    Collective("reduce_scatter", "tp", "sp activations", 2 * sub + 2 * replayed, act)]  # fmt: skip
            norms = (2 * blocks + (1 if last else 0)) * c.norm_params
            out.append(Collective("all_reduce", "tp", "sp norm weight grads", norms, c.hidden * g))
            if first:
                out += [Collective("reduce_scatter", "tp", "embedding", n, act), Collective("all_gather", "tp", "embedding", n, act)]
            if last:
                out += [Collective("all_gather", "tp", "head input", 2 * n, act), Collective("reduce_scatter", "tp", "head", n, act)]
        else:
            out.append(Collective("all_reduce", "tp", "activations", 2 * sub + 2 * replayed, act))
            out += [Collective("all_reduce", "tp", "embedding", n, act)] if first else []
            out += [Collective("all_reduce", "tp", "head input grad", n, act)] if last else []
        if c.groups < c.tp:  # fewer key/value groups than ranks: the QKV output gathered, its gradient reduce-scattered
            qkv = c.micro_batch * c.tokens * (c.heads + 2 * c.groups) * c.head_dim * e
            out += [Collective("all_gather", "tp", "qkv output", blocks * n + replayed, qkv), Collective("reduce_scatter", "tp", "qkv output", blocks * n, qkv)]
        if c.qk_norm:  # qk-layernorm weights see their rank's heads: their gradients summed over tp
            out.append(Collective("all_reduce", "tp", "qk norm weight grads", 2 * blocks * c.norm_params, c.head_dim * g))
        if last:
            out.append(Collective("all_reduce", "tp", "vocab-parallel loss", 3 * n, c.micro_batch * c.tokens * FP32))
    if c.pp > 1:
        seq = c.tokens // c.tp if c.sequence_parallel else c.tokens
        boundaries = sum(1 for s in stages if s != c.num_stages - 1) + sum(1 for s in stages if s != 0)
        message = c.micro_batch * seq * c.hidden * c.residual_bytes
        out += [Collective("send", "pp", "activations", n * boundaries, message), Collective("recv", "pp", "activations", n * boundaries, message)]
    moe = [i for s in stages for i in stage_blocks(c, s) if is_moe_block(c, i)]
    if c.ep > 1 and moe:
        rerun = rerun_moe_layers(c, stages)  # selective 'moe' or full: Megatron's replay has no early stop either
        rows = routed_rows(c) * c.hidden * e
        held = moe_layers_held(c, stages)  # the prediction modules' MoE layers too
        out += [Collective("all_to_all", "ep", "dispatch + combine", (4 * held + 2 * rerun) * n, rows),
                Collective("all_gather", "ep", "tokens per expert", (held + rerun) * n, c.ep * c.experts * 8)]  # fmt: skip
    if c.efsdp > 1 and moe:
        experts = len(moe) * padded_numel(expert_shapes(c), 1)
        out += [Collective("reduce_scatter", "efsdp", "dp expert grads", 1, experts * g),
                Collective("all_gather", "efsdp", "dp expert params", 1, experts * e)]  # fmt: skip
    if c.dp * c.cp > 1:
        params = 0
        for s in stages:
            params += sum(padded_numel(block_shapes(c, is_moe_block(c, i)), 1) for i in stage_blocks(c, s))
            params += padded_numel(embedding_shapes(c), 1) if s == 0 else 0
            # the last stage's copy of a tied embedding is a parameter of its own there too
            params += padded_numel(head_shapes(c, with_output=not (c.tied and s == 0)), 1) if s == c.num_stages - 1 else 0
        dim = "dp_shard_cp" if c.cp > 1 else "dp_shard"
        reduction = "all_reduce" if c.muon else "reduce_scatter"  # Muon's layer-wise optimizer: plain DDP
        out += [Collective(reduction, dim, "dp grads", 1, params * g), Collective("all_gather", dim, "dp params", 1, params * e)]
    if c.muon and c.tp > 1:
        whole = [comm_muon.whole(p, c.tp) * FP32 for u in comm_muon.muon_units(c, stages, block_shapes) for p in u if p.tp_sharded]
        out += [Collective("all_gather", "tp", "muon update over tp", 1, size) for size in whole]
    if c.pp > 1 and c.tied and first != last:
        out.append(Collective("all_reduce", "tied", "tied embedding grads", 1, c.vocab // c.tp * c.hidden * g))
    out.append(Collective("all_reduce", "world", "grad norm", 1, FP32))
    if c.dp * c.cp > 1:
        out.append(Collective("all_reduce", "dp_cp", "loss and tokens", 1, 2 * FP32))
    if c.fp16:
        out.append(Collective("all_reduce", "world", "fp16 overflow", 1, FP32))
    return out


def sent_by_class(c: CommLayout, collectives: list[Collective]) -> dict[str, float]:
    sent = dict.fromkeys(CLASSES, 0.0)
    for col in collectives:
        sent[collective_class(col)] += link_bytes(col, group_size(c, col.dim))
    return sent


def compare(cfg, world_size: int) -> list[tuple[int, str, float, float]]:
    """(pp rank, class, dtgpt bytes sent, Megatron's) for every pp rank and class."""
    c = CommLayout.from_config(cfg, world_size, padded_vocabulary(cfg, tokenizer_vocab_size(cfg)[0]))
    n = num_microbatches(cfg, c.dp, cfg.training.global_batch_size)
    rows = []
    for pp_rank in range(c.pp):
        ours = sent_by_class(c, rank_collectives(c, pp_rank, n))
        theirs = sent_by_class(c, megatron_collectives(c, pp_rank, n))
        rows += [(pp_rank, name, ours[name], theirs[name]) for name in CLASSES]
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int)
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides, check=False)
    except (ConfigError, OSError) as e:  # a key misspelled, a config file missing
        print_error(str(e))
        return 2
    p = cfg.parallel
    if cfg.model.moe_enabled and p.tensor_model_parallel_size > 1:
        print("error: MoE under tp is not compared (module docstring): set parallel.tensor_model_parallel_size=1")
        return 2
    world = args.world_size or p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    rows = compare(cfg, world)
    print(f"{'pp rank':>7}  {'class':<22} {'dtgpt GB':>12} {'Megatron GB':>12} {'ratio':>6}")
    for pp_rank, name, ours, theirs in rows:
        if ours or theirs:
            ratio = f"{ours / theirs:6.3f}" if theirs else "     -"
            print(f"{pp_rank:>7}  {name:<22} {ours / 1e9:>12.4g} {theirs / 1e9:>12.4g} {ratio}")
    worse = [(r, name) for r, name, ours, theirs in rows if ours > theirs]
    print("dtgpt moves at most Megatron's bytes in every class" if not worse else f"dtgpt moves more in: {worse}")
    return 0 if not worse else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
