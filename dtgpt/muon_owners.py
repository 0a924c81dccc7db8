"""Muon's Newton-Schulz done once per matrix: each matrix has one owner among FSDP's shard ranks.

FSDP shards every matrix's rows over the shard ranks (dp_shard, or dp_shard x cp). Where every
rank gathered every matrix and orthogonalised it (dp times the work, one collective per matrix),
the shard ranks now split the matrices between them, balanced by size (`owners`):
  1. one all_to_all sends each rank's rows of every matrix to the matrix's owner;
  2. the owner puts the tp-local matrix together; tensor parallelism keeps Megatron's duplicated
     mode: one all-gather over tp of every matrix the owner holds, and each tp rank runs
     Newton-Schulz on the whole matrix;
  3. one all_to_all sends each rank its rows of the orthogonalised matrices back.
Rows travel padded to ceil(rows / shard ranks), as FSDP pads them (dtgpt.chunks), so that a message's size is
the same on every rank. The data is only moved, never summed: the result is bitwise the one the
full_tensor() path gives. The bytes are dtgpt.plan.comm_muon's formula.

An MoE layer's experts under ep with FSDP over the expert-data-parallel ranks (efsdp, or efsdp x
tp where tp folds in: one mesh dimension either way) are stacks (E/ep, rows, cols) whose every
expert's rows FSDP splits (Shard(1)). Each expert's slice is a matrix with an owner among those
ranks, chosen as above (`orthogonalise_owned_experts`): the same two all_to_alls for all the
stacks of a mesh, and each owner runs one batched iteration per stack over the experts it owns.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtgpt.chunks import chunk_rows, rows_of

SHARD_DIMS = ("dp_shard", "dp_shard_cp")
"""The mesh dimensions FSDP shards over (dtgpt.parallel.dims)."""


def owners(sizes: list[tuple[int, ...]], ranks: int) -> list[int]:
    """The owner of each matrix, by its key (whole elements first): the largest first, each to
    the rank with the least so far (lowest rank on a tie). Equal keys are interchangeable, so the
    planner (dtgpt.plan.comm_muon) gets each rank's load from the keys alone."""
    load, out = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: tuple(-k for k in sizes[i])):
        out[i] = min(range(ranks), key=lambda r: load[r])
        load[out[i]] += sizes[i][0]
    return out


class UpdateShard(NamedTuple):
    """One parameter's update as FSDP shards it: the local rows of its tp-local matrix."""

    local: torch.Tensor
    rows: int  # of the tp-local matrix
    tp_dim: int | None  # the tensor dimension tp shards, None if tp does not


def shard_mesh_dim(u: torch.Tensor) -> int | None:
    """The mesh dimension FSDP shards `u` over, None for a tensor FSDP does not shard."""
    if not isinstance(u, DTensor):
        return None
    names = u.device_mesh.mesh_dim_names or ()
    return next((i for i, n in enumerate(names) if n in SHARD_DIMS and _shards(u.placements[i])), None)


def _shards(placement) -> bool:
    """Shard, or FSDP's strided shard over a tp-sharded dim 0 (which is_shard() does not own to)."""
    return not (placement.is_replicate() or placement.is_partial())


def expert_rows_mesh_dim(u: torch.Tensor) -> int | None:
    """The mesh dimension FSDP splits each expert's rows over in the stack `u` (E, rows, cols),
    None where every expert is whole on its rank (ep alone, or FSDP over the expert axis)."""
    if not isinstance(u, DTensor):
        return None
    return next((i for i, p in enumerate(u.placements) if p.is_shard(1)), None)


def update_shard(u: DTensor) -> UpdateShard:
    names = u.device_mesh.mesh_dim_names
    tp = next((p for n, p in zip(names, u.placements) if n == "tp" and p.is_shard()), None)
    tp_size = u.device_mesh.size(names.index("tp")) if tp is not None else 1
    rows = u.shape[0] // tp_size if tp is not None and tp.dim == 0 else u.shape[0]
    return UpdateShard(u.to_local(), rows, tp.dim if tp is not None else None)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.size(0), *x.shape[1:])]) if x.size(0) < rows else x


def matrix_key(pieces: list[tuple[int, int, int]]) -> tuple[int, int, int, int]:
    """The ownership key of a matrix from its parameters' (tp-local rows, cols, tp shards): whole
    elements, tp-local elements, parameters, rows. Matrices with equal keys move equal bytes."""
    return (sum(r * c * t for r, c, t in pieces), sum(r * c for r, c, _ in pieces), len(pieces), pieces[0][0])


def orthogonalise_owned(
    units: list[list[DTensor]], orthogonalise: Callable[[int, list[torch.Tensor]], list[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """Each unit's pieces (one parameter's update, or SwiGLU's [gate, fc1]) orthogonalised as one
    matrix by its owner: `orthogonalise(unit index, whole pieces)` gives the whole orthogonal
    pieces; returned: this rank's local rows of each, as FSDP holds them (module doc)."""
    first = units[0][0]
    mesh, f = first.device_mesh, shard_mesh_dim(first)
    tp_group, tp, tp_rank = _tp_of([u for unit in units for u in unit])
    pieces = [[update_shard(u) for u in unit] for unit in units]
    owner = owners([matrix_key([(p.rows, p.local.size(1), tp if p.tp_dim is not None else 1) for p in ps]) for ps in pieces], mesh.size(f))
    x = _Exchange(pieces, owner, mesh.get_group(f), mesh.get_local_rank(f))
    mine = x.owned_by(x.me)
    wholes = _gathered_over_tp(x.to_owners(), x.pieces, tp, tp_group)
    orth = {}
    for i in mine:
        for k, (p, o) in enumerate(zip(x.pieces[i], orthogonalise(i, [wholes[i, k] for k in range(len(x.pieces[i]))]))):
            orth[i, k] = o.chunk(tp, dim=p.tp_dim)[tp_rank] if p.tp_dim is not None else o
    return x.back(orth)


def orthogonalise_owned_experts(stacks: list[DTensor], orthogonalise: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Each expert of the stacks (on one mesh, each expert's rows split over one of its
    dimensions) orthogonalised by its owner: `orthogonalise(experts)` gives a stack of whole
    matrices' orthogonal updates; returned: this rank's local rows of each stack's, as FSDP holds them."""
    mesh, f = stacks[0].device_mesh, expert_rows_mesh_dim(stacks[0])
    experts = [(s, e) for s, u in enumerate(stacks) for e in range(u.to_local().size(0))]
    pieces = [[UpdateShard(stacks[s].to_local()[e], stacks[s].shape[1], None)] for s, e in experts]
    owner = owners([matrix_key([(stacks[s].shape[1], stacks[s].shape[2], 1)]) for s, _ in experts], mesh.size(f))
    x = _Exchange(pieces, owner, mesh.get_group(f), mesh.get_local_rank(f))
    wholes, mine, orth = x.to_owners(), x.owned_by(x.me), {}
    for s in range(len(stacks)):  # one batched iteration per stack, over the experts this rank owns
        owned = [i for i in mine if experts[i][0] == s]
        if owned:
            orth.update({(i, 0): o for i, o in zip(owned, orthogonalise(torch.stack([wholes.pop((i, 0)) for i in owned])))})
    local = [piece for [piece] in x.back(orth)]
    return [torch.stack([local[i] for i, (t, _) in enumerate(experts) if t == s]) for s in range(len(stacks))]


class _Exchange:
    """The matrices' rows between the n shard ranks (`pieces` per matrix, `owner` per matrix): in
    each message every piece's rows padded to ceil(rows / n), ordered by owner then matrix."""

    def __init__(self, pieces: list[list[UpdateShard]], owner: list[int], group, me: int):
        self.pieces, self.owner, self.group, self.me = pieces, owner, group, me
        self.n = dist.get_world_size(group)

    def owned_by(self, rank: int) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o == rank]

    def pad(self, p: UpdateShard) -> int:
        return chunk_rows(p.rows, self.n)

    def size(self, matrices: list[int]) -> int:
        """Elements of one rank's padded rows of these matrices."""
        return sum(self.pad(p) * p.local.size(1) for i in matrices for p in self.pieces[i])

    def to_owners(self) -> dict[tuple[int, int], torch.Tensor]:
        """1. Every rank's rows of each matrix to its owner: {(matrix, piece): the tp-local matrix}
        of those this rank owns."""
        n, mine = self.n, self.owned_by(self.me)
        send = [_padded(p.local, self.pad(p)).flatten() for d in range(n) for i in self.owned_by(d) for p in self.pieces[i]]
        per_source = self.size(mine)
        received = _all_to_all(torch.cat(send), [self.size(self.owned_by(d)) for d in range(n)], [per_source] * n, self.group)
        received, out, at = received.view(n, per_source), {}, 0
        for i in mine:
            for k, p in enumerate(self.pieces[i]):
                chunks = received[:, at : at + self.pad(p) * p.local.size(1)].reshape(n, self.pad(p), -1)
                out[i, k] = torch.cat([chunks[s, : rows_of(p.rows, n, s)] for s in range(n)])
                at += chunks[0].numel()
        return out

    def back(self, orth: dict[tuple[int, int], torch.Tensor]) -> list[list[torch.Tensor]]:
        """3. Each rank's rows of the orthogonalised tp-local matrices (`orth`, this rank's) back."""
        n, mine = self.n, self.owned_by(self.me)
        send = [_padded(orth[i, k][s * self.pad(p) :][: rows_of(p.rows, n, s)], self.pad(p)).flatten()
                for s in range(n) for i in mine for k, p in enumerate(self.pieces[i])]  # fmt: skip
        from_owner = [self.size(self.owned_by(s)) for s in range(n)]
        empty = self.pieces[0][0].local.new_zeros(0)
        returned = _all_to_all(torch.cat(send) if send else empty, [self.size(mine)] * n, from_owner, self.group)
        out, at = [[None] * len(ps) for ps in self.pieces], 0
        for s in range(n):
            for i in self.owned_by(s):
                for k, p in enumerate(self.pieces[i]):
                    out[i][k] = returned[at : at + p.local.numel()].view_as(p.local)
                    at += self.pad(p) * p.local.size(1)
        return out


def _tp_of(updates: list[DTensor]) -> tuple[object, int, int]:
    """(group, size, this rank) of the tp mesh dimension any update is sharded over; (None, 1, 0)."""
    for u in updates:
        names = u.device_mesh.mesh_dim_names
        if "tp" in names and u.placements[names.index("tp")].is_shard():
            t = names.index("tp")
            return u.device_mesh.get_group(t), u.device_mesh.size(t), u.device_mesh.get_local_rank(t)
    return None, 1, 0


def _all_to_all(x: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], group) -> torch.Tensor:
    if len(send_sizes) == 1:  # one shard rank: nothing to move
        return x
    out = x.new_empty(sum(receive_sizes))
    dist.all_to_all_single(out, x, receive_sizes, send_sizes, group=group)
    return out


def _gathered_over_tp(tp_local: dict, pieces: list[list[UpdateShard]], tp: int, group) -> dict:
    """The tp-local matrices whole: one all-gather over tp of those tp shards (Megatron's
    duplicated mode, coalesced), the rest as they are."""
    sharded = [key for key in tp_local if pieces[key[0]][key[1]].tp_dim is not None]
    if not sharded or tp == 1:
        return dict(tp_local)
    flat = torch.cat([tp_local[key].flatten() for key in sharded])
    gathered = flat.new_empty(tp * flat.numel())
    dist.all_gather_into_tensor(gathered, flat, group=group)
    gathered, out, at = gathered.view(tp, -1), dict(tp_local), 0
    for key in sharded:
        x = tp_local[key]
        part = gathered[:, at : at + x.numel()].reshape(tp, *x.shape)
        out[key] = torch.cat(list(part), dim=pieces[key[0]][key[1]].tp_dim)
        at += x.numel()
    return out
