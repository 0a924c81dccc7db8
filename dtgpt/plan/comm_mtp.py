"""The collectives of multi-token prediction (dtgpt/mtp.py), on the ranks of the last stage,
per rank and iteration with D prediction modules (the terms dtgpt.plan.comm adds):

  FSDP  apply_fsdp wraps the blocks, the embedding and the head, not the modules: their
        parameters (three norms, eh_proj (h/tp, 2h), a block of the last block's kind) belong
        to the model's root unit, which then gathers and reduces them as any unit. A later
        pipeline stage with the modules also holds its copy of the word embedding: a unit of its
        own, and its gradient summed with the first stage's (the tied all-reduce).
  CP    per module and micro-batch: its block gathers keys and values as every block does (again
        where selective recomputation reruns the core); 3 all-gathers of 2·cp·b int64 (the two
        chunk heads of the token ids, positions and labels) that shift them across the cp chunks
        (dtgpt/parallel/context_shift.py); per micro-batch 1 all-reduce of the D depths' loss-token
        counts (fp32).
  TP    per module and micro-batch, with a = b·s·h·e as in dtgpt.plan.comm: its block's
        collectives as every block's (counted among the blocks there, their norms' and qk-norms'
        gradient sums too, with the module's three norms under SP); the embedding's and the
        head's with its loss, which it runs again (the same formulas, run D·n times more);
        eh_proj, column-parallel with its output gathered whole: without SP 1 all-gather of a
        forward and 1 all-reduce of its 2a input gradient backward; with SP 1 all-gather of its
        2a input forward and 1 of its output (a, then this rank's chunk), 1 all-gather of the
        output gradient (a) and 1 reduce-scatter of the 2a input gradient backward.
  per iteration  the loss statistics all-reduce carries D more fp32 (each depth's loss).

  MoE   a module's block of the MoE kind is one more MoE layer of the last stage (dtgpt.plan.
        comm_moe.moe_layers_held): its all-to-all over ep, its router's load counts, its experts'
        FSDP unit (or its unit with tp folded in) and tp sums, its routing statistics.
"""

from __future__ import annotations

from dtgpt.plan import comm_embedding, comm_mla, comm_moe

INT64 = 8


def mtp_shapes(c, block_shapes) -> list[tuple[int, ...]]:
    """The D modules' tp-local parameter shapes; block_shapes(c, moe) gives their blocks' (dtgpt.plan.comm's)."""
    h = c.hidden
    norms = [(h,)] * c.norm_params * 3
    block = block_shapes(c, comm_moe.is_moe_block(c, c.num_layers - 1))
    return (norms + [(h // c.tp, 2 * h)] + block) * c.mtp


def mtp_units(c, stage: int, units: list, block_shapes) -> list:
    """fsdp_units of `stage` with the modules' parameters in the root unit (and a later stage's
    copy of the word embedding as a unit); block_shapes as mtp_shapes takes it."""
    if not c.mtp or stage != c.num_stages - 1:
        return units
    if stage != 0:
        units = units + [("embedding copy", [(c.vocab // c.tp, c.hidden)], False)]
    if not any(root for _, _, root in units):
        return units + [("root", mtp_shapes(c, block_shapes), True)]
    return [(name, shapes + mtp_shapes(c, block_shapes), True) if root else (name, shapes, root) for name, shapes, root in units]


def mtp_cp_collectives(c, stages: list[int], n_micro: int, collective) -> list:
    if not c.mtp or c.cp == 1 or c.num_stages - 1 not in stages:
        return []
    blocks = c.mtp * n_micro
    rerun = blocks if c.recompute[0] == "selective" else 0
    if c.latent is not None:
        cores = comm_mla.latent_cp_collectives(c, collective, blocks + rerun, blocks)
    else:
        gathered = c.micro_batch * c.seq * c.groups * c.head_dim // c.tp * c.compute_bytes
        cores = [collective("all_gather", "cp", "mtp keys and values fwd", 2 * (blocks + rerun), gathered),
                 collective("reduce_scatter", "cp", "mtp key and value grads bwd", 2 * blocks, gathered)]  # fmt: skip
    return cores + [
        collective("all_gather", "cp", "mtp shifted tokens, positions, labels", 3 * blocks, 2 * c.cp * c.micro_batch * INT64),
        collective("all_reduce", "cp", "mtp loss tokens", n_micro, c.mtp * 4),
    ]


def mtp_blocks(c, stages: list[int]) -> int:
    """The prediction modules' blocks a rank's stages hold (all on the last stage)."""
    return c.mtp if c.num_stages - 1 in stages else 0


def head_calls(c, n_micro: int) -> int:
    """How often the last stage runs the head and its loss: once per micro-batch and once more per module."""
    return n_micro * (1 + c.mtp)


def mtp_tp_collectives(c, stages: list[int], n_micro: int, collective) -> list:
    """The modules' tp collectives outside their blocks and the head: the embedding's (the main
    model's formula, run D·n times) and eh_proj's."""
    calls = mtp_blocks(c, stages) * n_micro
    if c.tp == 1 or not calls:
        return []
    act = c.micro_batch * c.tokens * c.hidden * c.compute_bytes
    if c.sequence_parallel:
        eh_proj = [collective("all_gather", "tp", "mtp eh_proj output fwd, its grad bwd", 2 * calls, act),
                   collective("all_gather", "tp", "mtp eh_proj input fwd", calls, 2 * act),
                   collective("reduce_scatter", "tp", "mtp eh_proj input grad bwd", calls, 2 * act)]  # fmt: skip
    else:
        eh_proj = [collective("all_gather", "tp", "mtp eh_proj output fwd", calls, act),
                   collective("all_reduce", "tp", "mtp eh_proj input grad bwd", calls, 2 * act)]  # fmt: skip
    return comm_embedding.embedding_tp_collectives(c, calls, collective) + eh_proj
