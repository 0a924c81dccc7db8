"""Muon's optimizer step (--optimizer muon, dtgpt/muon.py and dtgpt/muon_owners.py): what brings
each matrix's update together for Newton-Schulz, per rank and iteration.

Muon's matrices on a rank's stages: every block's QKV, projection, fc1 (with SwiGLU's gate: one
matrix [gate; fc1] of two parameters) and fc2, all tensor-parallel; the learned position embedding
on the first stage (replicated over tp); the prediction modules' eh_proj and block on the last.
Updates are fp32 (the momentum is sharded as the fp32 parameter). With f = FSDP's shard ranks
(dp_shard x cp), each matrix has an owner among them (dtgpt.muon_owners.owners, by size), and a
rank at shard coordinate r, owning the matrices O(r):

  FSDP        1 all_to_all over the f ranks of every matrix's rows: Σ ceil(rows/f)·cols·4 over all
              parameters (rows padded as FSDP pads them), and 1 back of Σ f·ceil(rows/f)·cols·4
              over O(r)'s; f = 1 moves nothing.
  tp          under FSDP 1 all-gather of O(r)'s tp-sharded matrices, whole: Σ rows·cols·4 (whole
              shapes); without FSDP 1 all-gather per tp-sharded parameter of its whole matrix
              (Megatron's duplicated mode, one collective per matrix as Megatron's).

The planner's rank (no shard coordinate given) is the one that owns the most.

Memory at the step (dtgpt.plan.layout's muon_step term, what it holds beyond the activations
that backward has freed): 4·(O_tp + O_whole + 2·R + 4·W) bytes, with O_tp and O_whole the owned
matrices tp-local and whole (received, then gathered over tp), R a rank's padded rows of every
matrix (the two all_to_all buffers), W the largest owned whole matrix (Newton-Schulz's iterate,
its products and the scaled result). Without FSDP a matrix is gathered at a time: O = W.
"""

from __future__ import annotations

from typing import NamedTuple

from dtgpt.muon_owners import matrix_key, owners
from dtgpt.plan import comm_moe, comm_mtp

FP32 = 4


class PieceShape(NamedTuple):
    rows: int  # tp-local
    cols: int  # tp-local
    tp_sharded: bool


def muon_units(c, stages: list[int], block_shapes) -> list[list[PieceShape]]:
    """Every Muon matrix the stages hold, as its parameters' tp-local pieces (block_shapes:
    dtgpt.plan.comm's: a block's 2-D shapes are QKV, projection, fc1, SwiGLU's gate, fc2)."""
    sharded = c.tp > 1
    matrices = [PieceShape(*s, sharded) for s in block_shapes(c) if len(s) == 2]
    block = [[m] for m in matrices[:2]] + ([matrices[2:4]] if c.swiglu else [[matrices[2]]]) + [[matrices[-1]]]
    out = []
    for stage in stages:
        out += block * (len(comm_moe.stage_blocks(c, stage)) + comm_mtp.mtp_blocks(c, [stage]))
        if stage == 0 and c.positions:
            out.append([PieceShape(c.positions, c.hidden, False)])
        if stage == c.num_stages - 1 and c.mtp:
            out += [[PieceShape(c.hidden // c.tp, 2 * c.hidden, sharded)]] * c.mtp  # eh_proj
    return out


def whole(p: PieceShape, tp: int) -> int:
    return p.rows * p.cols * (tp if p.tp_sharded else 1)


def ownership_key(unit: list[PieceShape], tp: int) -> tuple[int, ...]:
    return matrix_key([(p.rows, p.cols, tp if p.tp_sharded else 1) for p in unit])


def owned_units(c, stages: list[int], block_shapes, shard_rank: int | None) -> tuple[list[list[PieceShape]], list[list[PieceShape]]]:
    """(all matrices, those the rank at FSDP shard coordinate shard_rank owns; None: the busiest)."""
    units, f = muon_units(c, stages, block_shapes), c.shard
    keys = [ownership_key(u, c.tp) for u in units]
    owner = owners(keys, f)
    if shard_rank is None:
        shard_rank = max(range(f), key=lambda r: sum(k[0] for k, o in zip(keys, owner) if o == r))
    return units, [u for u, o in zip(units, owner) if o == shard_rank]


def step_bytes(c, stages: list[int], block_shapes, shard_rank: int | None = None) -> int:
    """The Muon step's transient bytes (module doc)."""
    if not c.muon:
        return 0
    units, mine = owned_units(c, stages, block_shapes, shard_rank)
    wholes = [sum(whole(p, c.tp) for p in u) for u in (mine if c.fsdp_applied else units)]
    largest = max(wholes, default=0)
    if not c.fsdp_applied:
        return FP32 * 5 * largest
    owned_tp = sum(p.rows * p.cols for u in mine for p in u)
    rows = sum(-(-p.rows // c.shard) * p.cols for u in units for p in u)
    return FP32 * (owned_tp + sum(wholes) + 2 * rows + 4 * largest)


def muon_collectives(c, stages: list[int], block_shapes, collective, shard_rank: int | None = None) -> list:
    if not c.muon:
        return []
    units = muon_units(c, stages, block_shapes)
    if not c.fsdp_applied:
        return [collective("all_gather", "tp", "muon update over tp", 1, whole(p, c.tp) * FP32) for u in units for p in u if p.tp_sharded]
    f = c.shard
    units, mine = owned_units(c, stages, block_shapes, shard_rank)

    def moved(us: list[list[PieceShape]], times: int) -> int:
        return sum(times * -(-p.rows // f) * p.cols * FP32 for u in us for p in u)

    out = []
    if f > 1:
        dim = "dp_shard_cp" if c.cp > 1 else "dp_shard"
        out += [collective("all_to_all", dim, "muon update rows to their owners", 1, moved(units, 1)),
                collective("all_to_all", dim, "muon orthogonal rows back", 1, moved(mine, f))]  # fmt: skip
    gathered = sum(whole(p, c.tp) * FP32 for u in mine for p in u if p.tp_sharded)
    if gathered:
        out.append(collective("all_gather", "tp", "muon owned updates over tp", 1, gathered))
    return out
