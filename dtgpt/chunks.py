"""How n rows split among k ranks as torch.chunk splits them, and with it DTensor's Shard and
FSDP2's Shard(0): ceil(n / k) rows each, the last ranks what is left (perhaps none), and a
collective pads every rank's chunk up to ceil(n / k) so that each sends the same size.

One home for the runtime (dtgpt/muon_owners.py pads Muon's rows so) and the planner
(dtgpt/plan: what FSDP gathers, each rank's shapes, Muon's all_to_alls): plain integers, so the
planner needs no process group.
"""

from __future__ import annotations

import math


def chunk_rows(rows: int, ranks: int) -> int:
    """The rows of a full chunk: ceil(rows / ranks), what every rank's chunk is padded to."""
    return -(-rows // ranks)


def rows_of(rows: int, ranks: int, rank: int) -> int:
    """The rows `rank` holds among `ranks`: a full chunk, the remainder, or none."""
    per = chunk_rows(rows, ranks)
    return max(0, min(per, rows - rank * per))


def padded_numel(shapes: list[tuple[int, ...]], ranks: int, dim: int = 0) -> int:
    """Elements FSDP gathers over `ranks`: each tensor's dimension `dim` padded up to ranks full
    chunks."""
    return sum(math.prod((*s[:dim], chunk_rows(s[dim], ranks) * ranks, *s[dim + 1 :])) for s in shapes)
