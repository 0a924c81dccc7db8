"""The mixture-of-experts terms of the communication model (dtgpt.plan.comm): the MoE block's
parameter shapes as FSDP holds them, and the all-to-all token exchange of expert parallelism.

With E experts, top-k routing, ep expert-parallel ranks and N = b·s/tp tokens a rank routes per
micro-batch (each tp rank routes its own sequence chunk under SP), per MoE layer:

  all-to-all over ep, per micro-batch: dropless (or a capacity that only drops), 1 exchange of
       the per-expert counts (E int64) forward (padded to capacity, none: the sizes are static),
       then the routed rows, R·h·e bytes each (R = N·k dropless, E·capacity when padded to
       capacity, at most N·k when a capacity drops tokens): dispatch and combine forward, the
       same two backward; a recomputed MoE layer (full recomputation, selective 'moe') runs its
       forward again, counts and both exchanges (dtgpt.plan.comm_recompute). Each rank sends its own R rows; what it receives depends on the
       routing, so R·h·e is the mean over the ep ranks (their sum is exact).
  under tp (+ SP) and cp: the router and the experts run on the rank's own tokens, so an MoE
       block has no SP gather/scatter around its MLP (only the attention's); the router's
       per-expert load counts (E int64, B·E for seq_aux_loss) are summed over the ranks holding
       chunks of the same sequences (cp x tp) per micro-batch, again in a recomputed forward. The
       router's and experts' gradients, partial over tp, are summed over tp once per iteration:
       under FSDP (HSDP excepted) tp folds into their units, as Megatron folds it into its
       expert-data-parallel group: each MoE layer is a unit over dp_shard·cp·tp holding its
       router (and, without ep, its experts; with ep, the experts' unit spans efsdp·tp), one
       all-gather and one reduce-scatter per iteration, and its shared expert a unit over
       dp_shard·cp; without FSDP they join the one all-reduce of every pending tp sum
       (dtgpt.plan.comm); under HSDP FSDP all-reduces each over tp (in the compute dtype with
       one micro-batch, else in the reduce dtype, as SP's norms).
  FSDP over efsdp = dp_shard·cp/ep (the ranks left once ep is folded out, times tp where tp
       folds in): each MoE layer's
       experts are a unit of their own, E/ep experts sharded on their second axis; one
       all-gather and one reduce-scatter per iteration as any unit, none at efsdp = 1; HSDP adds
       the all-reduce of the shard over dp_replicate. The router (E x h) and the shared expert
       stay in the block's unit.
"""

from __future__ import annotations

import math

from dtgpt.chunks import padded_numel
from dtgpt.config.layer_freq import moe_layer_pattern

# `c` below is a dtgpt.plan.comm.CommLayout and `collective` its Collective class, passed in:
# comm imports this module, and the plan package's imports run one way.


def is_moe_block(c, index: int) -> bool:
    """Block `index` (global, from 0) holds an MoE layer, as model.moe_layer_freq says."""
    return c.experts > 0 and moe_layer_pattern(c.moe_layer_freq, c.num_layers)[index]


def stage_blocks(c, stage: int) -> list[int]:
    """The global indices of a stage's blocks."""
    first = sum(c.layer_counts[:stage])
    return list(range(first, first + c.layer_counts[stage]))


def mlp_shapes(c, width: int) -> list[tuple[int, ...]]:
    """A tensor-parallel MLP of `width`: fc1 (and SwiGLU's gate) column-split, fc2 row-split."""
    tp = c.tp
    mlp_in = [(width // tp, c.hidden)] + [(width // tp,)] * c.bias
    return mlp_in * (2 if c.swiglu else 1) + [(c.hidden, width // tp)] + [(c.hidden,)] * c.bias


def tp_folds_in(c) -> bool:
    """ParallelDims.tp_folds_into_moe: the MoE layers' FSDP units span tp."""
    return c.experts > 0 and c.tp > 1 and c.fsdp_applied and c.dp_replicate == 1


def router_shapes(c) -> list[tuple[int, ...]]:
    """The router's, and the shared expert's gate's: the MoE layer's own parameters, replicated over tp."""
    return [(c.experts, c.hidden)] + [(c.experts,)] * c.bias + [(1, c.hidden)] * (c.shared_gate and c.shared_ffn > 0)


def moe_block_shapes(c) -> list[tuple[int, ...]]:
    """What an MoE layer leaves in its block's FSDP unit: the router (replicated over tp) and the
    shared expert (tensor-parallel as a dense MLP), without ep the experts; nothing where tp folds in (units of their own)."""
    if tp_folds_in(c):
        return []
    experts = expert_shapes(c) if c.ep == 1 else []  # under ep, a unit of their own
    return router_shapes(c) + experts + (mlp_shapes(c, c.shared_ffn) if c.shared_ffn else [])


def moe_layers_held(c, stages: list[int]) -> int:
    """The MoE layers of a rank's stages: their blocks', and on the last stage the multi-token
    prediction modules' (each module's block is of the last block's kind; dtgpt.plan.comm_mtp)."""
    return sum(1 for s in stages for i in stage_blocks(c, s) if is_moe_block(c, i)) + mtp_moe_layers(c, stages)


def mtp_moe_layers(c, stages: list[int]) -> int:
    return c.mtp if c.num_stages - 1 in stages and is_moe_block(c, c.num_layers - 1) else 0


def moe_unit_collectives(c, stages: list[int], n_micro: int, collective) -> list:
    """Where tp folds in (module docstring): each MoE layer's unit over dp_shard·cp·tp, one
    all-gather (again per micro-batch where FSDP reshards after forward) and one reduce-scatter
    of all its gradients; its shared expert's unit over dp_shard·cp."""
    if not tp_folds_in(c):
        return []
    layers = moe_layers_held(c, stages)
    gathers = 2 * n_micro if c.reshard_every_micro_batch and c.pp == 1 else 1
    numel = padded_numel(router_shapes(c) + (expert_shapes(c) if c.ep == 1 else []), c.shard * c.tp)
    out = [collective("all_gather", "moe_fsdp", "fsdp moe layer params", layers * gathers, numel * c.compute_bytes),
           collective("reduce_scatter", "moe_fsdp", "fsdp moe layer grads", layers, numel * c.grad_bytes)]  # fmt: skip
    if c.shared_ffn and c.shard > 1:
        numel = padded_numel(mlp_shapes(c, c.shared_ffn), c.shard)
        out += [collective("all_gather", "dp_shard_cp", "fsdp shared expert params", layers * gathers, numel * c.compute_bytes),
                collective("reduce_scatter", "dp_shard_cp", "fsdp shared expert grads", layers, numel * c.grad_bytes)]  # fmt: skip
    return out


def replicated_numel(c, stages: list[int]) -> int:
    """Elements of the router and expert gradients a rank holds as partial sums over tp (none
    where tp folds into their FSDP units)."""
    if c.experts == 0 or c.tp == 1 or tp_folds_in(c):
        return 0
    return moe_layers_held(c, stages) * sum(math.prod(s) for s in router_shapes(c) + expert_shapes(c))


def expert_shapes(c) -> list[tuple[int, ...]]:
    """One MoE layer's stacked experts on a rank: E/ep of them, whole (replicated over tp)."""
    local, f, h = c.experts // c.ep, c.expert_ffn, c.hidden
    fc1 = (2 if c.swiglu else 1) * f
    return [(local, fc1, h), (local, h, f)] + ([(local, fc1), (local, h)] if c.bias else [])


def expert_shards(c) -> int:
    """The ranks of the experts' FSDP unit under ep: efsdp, times tp where tp folds in."""
    return c.efsdp * (c.tp if tp_folds_in(c) else 1)


def expert_gathered_numel(c) -> int:
    """Elements FSDP gathers for one expert unit: dim 1 padded up to a multiple of its shards."""
    return padded_numel(expert_shapes(c), expert_shards(c), dim=1)


def routed_rows(c) -> int:
    """R: the (token, expert) rows a rank sends its experts per micro-batch and MoE layer."""
    tokens = c.micro_batch * c.tokens // (c.tp if c.sequence_parallel else 1)
    if c.capacity_factor is not None and c.pad_to_capacity:
        return c.experts * math.ceil(tokens * c.topk / c.experts * c.capacity_factor)
    return tokens * c.topk


def expert_fsdp_collectives(c, stages: list[int], collective) -> list:
    """The experts' FSDP units: one gather and one reduce-scatter per MoE layer and iteration."""
    if c.ep == 1 or expert_shards(c) * c.dp_replicate == 1 or c.experts == 0:
        return []
    layers = moe_layers_held(c, stages)
    numel = expert_gathered_numel(c)
    shards = expert_shards(c)
    dim = "efsdp_tp" if tp_folds_in(c) else "efsdp"
    out = []
    if shards > 1:
        out += [collective("all_gather", dim, "fsdp experts params", layers, numel * c.compute_bytes),
                collective("reduce_scatter", dim, "fsdp experts grads", layers, numel * c.grad_bytes)]  # fmt: skip
    if c.dp_replicate > 1:
        out.append(collective("all_reduce", "dp_replicate", "hsdp experts grads", layers, numel // shards * c.grad_bytes))
    return out


def all_to_all_collectives(c, stages: list[int], n_micro: int, rerun: int, collective) -> list:
    """Expert parallelism's token exchange (module docstring); `rerun`: the MoE layers whose
    forward backward runs again (dtgpt.plan.comm_recompute)."""
    if c.ep == 1 or c.experts == 0:
        return []
    layers = moe_layers_held(c, stages)
    rows = routed_rows(c) * c.hidden * c.compute_bytes
    static = c.capacity_factor is not None and c.pad_to_capacity
    counts = [] if static else [collective("all_to_all", "ep", "tokens per expert fwd", (layers + rerun) * n_micro, 8 * c.experts)]
    return counts + [
        collective("all_to_all", "ep", "dispatch + combine fwd", 2 * (layers + rerun) * n_micro, rows),
        collective("all_to_all", "ep", "dispatch + combine grads bwd", 2 * layers * n_micro, rows),
    ]


def routing_stats_numel(c) -> int:
    """fp32 numbers an MoE model adds to the iteration's loss-and-norm all-reduce over the world
    (dtgpt/moe/stats.py): each logged router loss (per MoE layer with per-layer logging), then
    per MoE layer of the whole model its tokens per expert and its dropped tokens (the prediction
    modules' MoE layers too)."""
    if c.experts == 0:
        return 0
    losses = int(c.load_balancing != "none" and c.aux_loss_coeff > 0) + int(c.z_loss)
    layers = sum(1 for i in range(c.num_layers) if is_moe_block(c, i)) + mtp_moe_layers(c, [c.num_stages - 1])
    return losses * (layers if c.per_layer_logging else 1) + layers * (c.experts + 1)


def sequence_collectives(c, stages: list[int], n_micro: int, rerun: int, collective) -> list:
    """tp and cp's MoE terms (module docstring): the router's load counts (`rerun` MoE layers'
    again) and the gradients of the parameters tp replicates (router, experts)."""
    if c.experts == 0:
        return []
    layers = moe_layers_held(c, stages)
    out = []
    tp = c.tp if c.sequence_parallel else 1
    if c.cp * tp > 1 and c.load_balancing != "none" and c.aux_loss_coeff > 0:
        dim = "cp_tp" if c.cp > 1 and tp > 1 else "cp" if c.cp > 1 else "tp"
        counts = 8 * c.experts * (c.micro_batch if c.load_balancing == "seq_aux_loss" else 1)
        out.append(collective("all_reduce", dim, "router load counts", (layers + rerun) * n_micro, counts))
    if c.tp > 1 and c.fsdp_applied and not tp_folds_in(c):  # HSDP: FSDP sums each over tp
        grad = c.grad_bytes if n_micro > 1 else c.compute_bytes
        replicated = router_shapes(c) + expert_shapes(c)
        out += [collective("all_reduce", "tp", "router and expert grads", layers, math.prod(s) * grad) for s in replicated]
    return out
