"""What a recomputed forward communicates again (dtgpt.plan.comm), per rank and iteration.

Backward recomputes with non-reentrant torch.utils.checkpoint (dtgpt/parallel/recompute.py,
recompute_modules.py): the checkpointed function runs its forward again, collectives included,
but only up to the last tensor autograd saved in it (torch's early stop), and a tensor-parallel
module's input hook runs again only where the module is called inside that function. Counted
on real ranks (tests/test_comm_counts.py), that gives:

full            each recomputed block runs its forward collectives again: under tp with SP the
                all-gathers of its sub-layers' inputs and the reduce-scatters of their outputs,
                without SP the all-reduces of its outputs; the QKV output's gather where ranks
                share a key/value group; multi-latent attention's compressed-vector gathers (SP);
                an MoE layer's counts, dispatch and combine over ep and the router's load counts
                (dtgpt.plan.comm_moe); under cp the attention core's key/value gathers. Except the
                last block of each recomputed group: its last sub-layer's output reduce-scatter
                (all-reduce) feeds nothing saved, so the replay stops before it, unless hidden
                dropout keeps a mask after it. An MoE block ends with its combine (which the
                weighting by the routing probabilities keeps) or, with a shared expert, with that
                expert's reduce-scatter (kept only where a gate multiplies it).
selective       core_attn: under cp the core's key/value gathers, nothing over tp.
                mlp, shared_experts: nothing: the input's gather is the module's input hook, outside
                the checkpoint, and the replay stops before the output's reduce-scatter (all-reduce).
                moe: the whole MoE layer's forward: its all-to-alls and the router's load counts, a
                shared expert's input gather (and its output's reduce-scatter where a gate keeps it).
                mla_up_proj: under SP the up-projections' input gathers (compressed query, compressed
                key/value), once: the run that refills the discarded q, k, v before the core's
                backward also builds the graph the up-projections' own backward runs (as Megatron's).
                layernorm, moe_act: nothing (each recomputes from tensors the rank holds).
"""

from __future__ import annotations

from dtgpt.parallel.recompute import recompute_groups
from dtgpt.plan import comm_mla, comm_moe, comm_mtp

# `c` is a dtgpt.plan.comm.CommLayout and `collective` its Collective class (comm imports this module).


def recomputed_groups(c, stage: int) -> list[list[int]]:
    """The global indices of a stage's blocks, per group full recomputation replays as one."""
    granularity, method, num_layers = c.recompute
    if granularity != "full":
        return []
    blocks = comm_moe.stage_blocks(c, stage)
    return [[blocks[int(n)] for n in g] for g in recompute_groups([str(i) for i in range(len(blocks))], method, num_layers)]


def recomputed_blocks(c, stage: int) -> list[int]:
    """The global indices of a stage's blocks whose whole forward backward runs again."""
    return [i for group in recomputed_groups(c, stage) for i in group]


def recomputed_cores(c, stage: int) -> int:
    """Blocks of a stage whose attention core backward runs again (selective core_attn, or full)."""
    return c.layer_counts[stage] if "core_attn" in c.recompute_modules else len(recomputed_blocks(c, stage))


def rerun_moe_layers(c, stages: list[int]) -> int:
    """MoE layers whose forward backward runs again: selective 'moe' (the prediction modules' too), or full."""
    if "moe" in c.recompute_modules:
        return comm_moe.moe_layers_held(c, stages)
    return sum(1 for s in stages for i in recomputed_blocks(c, s) if comm_moe.is_moe_block(c, i))


def _ends_unsaved(c, block: int) -> bool:
    """The block's last collective is an output reduce-scatter (all-reduce) no saved tensor follows."""
    if comm_moe.is_moe_block(c, block):
        return c.shared_ffn > 0 and not c.shared_gate and not c.dropout
    return not c.dropout


def tp_replay_collectives(c, stages: list[int], n_micro: int, collective) -> list:
    """The tp collectives recomputed forwards run again (module docstring)."""
    if c.tp == 1:
        return []
    act = c.micro_batch * c.tokens * c.hidden * c.compute_bytes
    groups = [g for s in stages for g in recomputed_groups(c, s)]
    blocks = sum(len(g) for g in groups)
    moe = sum(1 for g in groups for i in g if comm_moe.is_moe_block(c, i))
    shared = moe if c.shared_ffn else 0
    inputs = (blocks if c.latent is None else 0) + blocks - moe + shared  # attention's, dense MLPs', shared experts'
    outputs = 2 * blocks - moe + shared - sum(1 for g in groups if _ends_unsaved(c, g[-1]))
    if "moe" in c.recompute_modules and c.sequence_parallel:  # a replayed MoE layer's shared expert
        layers = comm_moe.moe_layers_held(c, stages) if c.shared_ffn else 0
        inputs, outputs = inputs + layers, outputs + (layers if c.shared_gate else 0)
    out = []
    if c.sequence_parallel:
        out += [collective("all_gather", "tp", "recomputed sp inputs fwd", inputs * n_micro, act),
                collective("reduce_scatter", "tp", "recomputed sp outputs fwd", outputs * n_micro, act)]  # fmt: skip
    else:
        out.append(collective("all_reduce", "tp", "recomputed block outputs fwd", outputs * n_micro, act))
    if c.groups < c.tp and c.latent is None:
        qkv = c.micro_batch * c.tokens * (c.heads + 2 * c.groups) * c.head_dim * c.compute_bytes
        out.append(collective("all_gather", "tp", "recomputed qkv output fwd", blocks * n_micro, qkv))
    if c.latent is not None and c.sequence_parallel:
        gathers = [x for x in comm_mla.latent_tp_collectives(c, collective, blocks, n_micro) if x.kind == "all_gather"]
        out += [collective(x.kind, x.dim, "recomputed " + x.what, x.count, x.message_bytes) for x in gathers]
        if "mla_up_proj" in c.recompute_modules:  # refilled once per block and micro-batch
            up = (sum(c.layer_counts[s] for s in stages) + comm_mtp.mtp_blocks(c, stages)) * n_micro
            token_bytes = c.micro_batch * c.tokens * c.compute_bytes
            out += [collective("all_gather", "tp", f"recomputed mla {what} fwd", up, width * token_bytes)
                    for what, width in (("compressed query", c.latent.q_lora or c.hidden), ("compressed key/value", c.latent.kv_lora))]  # fmt: skip
    return [x for x in out if x.count]
