"""Muon's optimizer step (--optimizer muon, dtgpt/muon.py): the collectives that bring each
matrix's update together for Newton-Schulz.

Muon's matrices on a stage: every block's 2-D weights (QKV, projection, fc1 and SwiGLU's gate, fc2;
all tensor-parallel), the learned position embedding on the first stage (replicated over tp), and
the prediction modules' (their eh_proj and block) on the last. Updates are fp32 (the momentum is
sharded as the fp32 parameter). Per matrix and iteration, its update's full_tensor(): 1 all-gather
over FSDP's shard ranks of the tp-local matrix (dim 0 padded to a multiple of them), then, when
tp shards it, 1 all-gather of the whole matrix over tp.
"""

from __future__ import annotations

from typing import NamedTuple

from dtgpt.plan import comm_moe, comm_mtp

FP32 = 4


class MuonMatrix(NamedTuple):
    shape: tuple[int, int]
    """tp-local (rows, cols)"""
    tp_sharded: bool


def muon_matrices(c, stages: list[int], block_shapes) -> list[MuonMatrix]:
    """Every Muon parameter the stages hold (block_shapes: dtgpt.plan.comm's)."""
    sharded = c.tp > 1
    out = []
    for stage in stages:
        blocks = len(comm_moe.stage_blocks(c, stage)) + comm_mtp.mtp_blocks(c, [stage])
        out += [MuonMatrix(s, sharded) for s in block_shapes(c) if len(s) == 2] * blocks
        if stage == 0 and c.positions:
            out.append(MuonMatrix((c.positions, c.hidden), False))
        if stage == c.num_stages - 1 and c.mtp:
            out += [MuonMatrix((c.hidden // c.tp, 2 * c.hidden), sharded)] * c.mtp  # eh_proj
    return out


def muon_collectives(c, stages: list[int], block_shapes, collective) -> list:
    if not c.muon:
        return []
    out = []
    dim = "dp_shard_cp" if c.cp > 1 else "dp_shard"
    for m in muon_matrices(c, stages, block_shapes):
        rows, cols = m.shape
        if c.fsdp and c.shard > 1:
            padded = -(-rows // c.shard) * c.shard
            out.append(collective("all_gather", dim, "muon update shards", 1, padded * cols * FP32))
        if m.tp_sharded:
            out.append(collective("all_gather", "tp", "muon update over tp", 1, rows * cols * c.tp * FP32))
    return out
