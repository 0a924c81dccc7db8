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
  per iteration  the loss statistics all-reduce carries D more fp32 (each depth's loss).

Not modelled yet: the modules' tp collectives (their block's, eh_proj's, the embedding's and the
head's that they run again) and an MoE block's experts (their FSDP unit and all-to-all).
"""

from __future__ import annotations

from dtgpt.plan import comm_mla, comm_moe

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
