"""The vocabulary-parallel embedding's collectives in the communication model (dtgpt.plan.comm):
the first stage's, and multi-token prediction's on the last stage (dtgpt.plan.comm_mtp), which
embeds the shifted tokens again.
"""

from __future__ import annotations

# `c` is a dtgpt.plan.comm.CommLayout and `collective` its Collective class (comm imports this module).


def embedding_tp_collectives(c, calls: int, collective) -> list:
    """The embedding run `calls` times under tp: each rank's rows of the vocabulary give a
    partial output, summed forward (b·s·h·e); under SP the output gradient is gathered backward."""
    residual = c.micro_batch * c.tokens * c.hidden * c.compute_bytes
    out = [collective("all_reduce", "tp", "vocab-parallel embedding fwd", calls, residual)]
    if c.sequence_parallel:
        out.append(collective("all_gather", "tp", "embedding grad bwd", calls, residual))
    return out
