"""Muon's optimizer step (--optimizer muon, dtgpt/muon.py and dtgpt/muon_owners.py): what brings
each matrix's update together for Newton-Schulz, per rank and iteration.

Muon's matrices on a rank's stages: every block's QKV, projection, fc1 (with SwiGLU's gate: one
matrix [gate; fc1] of two parameters) and fc2, all tensor-parallel (an MoE block: its router,
shared expert and each expert's fc1 and fc2); the learned position embedding
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
  experts     whole on their rank (ep, or FSDP's expert axis without ep): nothing; where FSDP
              splits each expert's rows over n ranks (ep with efsdp, times tp where it folds in,
              > 1), each expert's matrix has an owner among them: 1 all_to_all of
              Σ ceil(rows/n)·cols·4 over every expert matrix, 1 back of Σ n·ceil(rows/n)·cols·4
              over the owned ones.
  router      where tp folds into its MoE layer's FSDP unit (a mesh of its own), 1 all-gather
              over dp x tp per matrix (the router's weight, the shared expert's gate), whole;
              elsewhere an owned matrix like the rest.
Multi-latent attention's down-projections are replicated over tp, its up-projections and output
projection tp-sharded: each is one matrix.

The planner's rank (no shard coordinate given) is the one that owns the most.

Memory at the step (dtgpt.plan.layout's muon_step term, what it holds beyond the activations
that backward has freed): 4·(O_tp + O_whole + 2·R + 4·W) bytes, with O_tp and O_whole the owned
matrices tp-local and whole (received, then gathered over tp), R a rank's padded rows of every
matrix (the two all_to_all buffers), W the largest owned whole matrix (Newton-Schulz's iterate,
its products and the scaled result). Without FSDP a matrix is gathered at a time: O = W. The
MoE layers' experts step first, if more than the above: whole on their rank, one stacked weight
at a time, 4·5·S for the largest stack S (the batched iteration's working set); owned,
4·(R_e + 2·O_e + 5·B) with R_e the rank's padded rows of every expert matrix, O_e its owned ones
whole (received, then orthogonalised) and B the largest batch (its owned experts of one stack).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from dtgpt.chunks import chunk_rows, padded_numel
from dtgpt.muon_owners import matrix_key, owners
from dtgpt.plan import comm_moe, comm_mtp

FP32 = 4


class PieceShape(NamedTuple):
    rows: int  # tp-local
    cols: int  # tp-local
    tp_sharded: bool


def muon_units(c, stages: list[int], block_shapes) -> list[list[PieceShape]]:
    """Every Muon matrix on the FSDP mesh of the stages' blocks, as its parameters' tp-local pieces
    (block_shapes: dtgpt.plan.comm's: a dense block's 2-D shapes are QKV, projection, fc1,
    SwiGLU's gate, fc2); an MoE layer's router where its unit spans tp, and the experts, apart."""
    out = []
    for stage in stages:
        blocks = comm_moe.stage_blocks(c, stage)
        kinds = [comm_moe.is_moe_block(c, i) for i in blocks] + [comm_moe.is_moe_block(c, c.num_layers - 1)] * comm_mtp.mtp_blocks(c, [stage])
        for moe in kinds:
            out += attention_units(c, block_shapes) + (moe_units(c) if moe else mlp_units(c, c.ffn))
        if stage == 0 and c.positions:
            out.append([PieceShape(c.positions, c.hidden, False)])
        if stage == c.num_stages - 1 and c.mtp:
            out += [[PieceShape(c.hidden // c.tp, 2 * c.hidden, c.tp > 1)]] * c.mtp  # eh_proj
    return out


def attention_units(c, block_shapes) -> list[list[PieceShape]]:
    """QKV and the projection; multi-latent attention's projections, the down ones replicated."""
    lat, sharded = c.latent, c.tp > 1
    if lat is None:
        return [[PieceShape(*s, sharded)] for s in block_shapes(c) if len(s) == 2][:2]
    h, heads = c.hidden, c.heads // c.tp
    up = PieceShape(heads * (lat.qk + lat.pos), lat.q_lora or h, sharded)
    query = [PieceShape(lat.q_lora, h, False), up] if lat.q_lora else [up]
    kv = [PieceShape(lat.kv_lora + lat.pos, h, False), PieceShape(heads * (lat.qk + lat.v), lat.kv_lora, sharded)]
    return [[p] for p in query + kv + [PieceShape(h, heads * lat.v, sharded)]]


def mlp_units(c, width: int) -> list[list[PieceShape]]:
    """A tensor-parallel MLP's fc1 (one matrix with SwiGLU's gate) and fc2."""
    fc1, *rest = [PieceShape(*s, c.tp > 1) for s in comm_moe.mlp_shapes(c, width) if len(s) == 2]
    return [[fc1, *rest[:-1]], [rest[-1]]]


def router_units(c) -> list[list[PieceShape]]:
    """The router's weight and the shared expert's gate (replicated over tp)."""
    return [[PieceShape(*s, False)] for s in comm_moe.router_shapes(c) if len(s) == 2]


def moe_units(c) -> list[list[PieceShape]]:
    """An MoE layer's matrices in its block's unit: the router (unless tp folds it into a unit of
    its own, dtgpt.plan.comm_moe.tp_folds_in) and the shared expert."""
    return ([] if comm_moe.tp_folds_in(c) else router_units(c)) + (mlp_units(c, c.shared_ffn) if c.shared_ffn else [])


def expert_units(c, stages: list[int]) -> list[PieceShape]:
    """Every expert matrix of the rank's MoE layers, as the step takes them: layer by layer,
    each stacked weight (fc1, fc2), expert by expert (E/ep a stack)."""
    shapes = comm_moe.expert_shapes(c)[:2]  # fc1, fc2 (not the biases)
    layers = comm_moe.moe_layers_held(c, stages)
    return [PieceShape(rows, cols, False) for _ in range(layers) for local, rows, cols in shapes for _ in range(local)]


def experts_split(c) -> bool:
    """Whether FSDP splits each expert's rows (ep with efsdp x tp > 1, dtgpt.muon_owners)."""
    return c.ep > 1 and comm_moe.expert_shards(c) > 1


def owned_experts(c, stages: list[int], shard_rank: int | None) -> tuple[list[PieceShape], list[int]]:
    """(every expert matrix, the indices of those owned by the rank at FSDP shard coordinate
    shard_rank among the experts' FSDP ranks; None: the busiest). Its expert coordinate is
    shard_rank // ep (ep is innermost, dtgpt.parallel.dims); where tp folds in, the busiest of
    its tp ranks (the planner's rank carries no tp coordinate)."""
    units, n = expert_units(c, stages), comm_moe.expert_shards(c)
    keys = [ownership_key([u], 1) for u in units]
    owner = owners(keys, n)
    fold = n // c.efsdp
    candidates = range(n) if shard_rank is None else [shard_rank // c.ep % c.efsdp * fold + t for t in range(fold)]
    rank = max(candidates, key=lambda r: sum(k[0] for k, o in zip(keys, owner) if o == r))
    return units, [i for i, o in enumerate(owner) if o == rank]


def expert_collectives(c, stages: list[int], collective, shard_rank: int | None) -> list:
    """The experts: whole on their rank (no communication) unless FSDP splits each expert's rows
    (ep with efsdp x tp > 1): then every expert's rows to its owner and back, 2 all_to_alls for
    all of them; and the router where its unit spans dp x tp, gathered whole over it."""
    out = []
    if experts_split(c) and comm_moe.moe_layers_held(c, stages):
        n, (units, mine) = comm_moe.expert_shards(c), owned_experts(c, stages, shard_rank)
        dim = "efsdp_tp" if comm_moe.tp_folds_in(c) else "efsdp"
        rows = [chunk_rows(u.rows, n) * u.cols * FP32 for u in units]
        out += [collective("all_to_all", dim, "muon expert rows to their owners", 1, sum(rows)),
                collective("all_to_all", dim, "muon orthogonal expert rows back", 1, n * sum(rows[i] for i in mine))]  # fmt: skip
    if comm_moe.tp_folds_in(c) and c.shard * c.tp > 1:
        out += [collective("all_gather", "moe_fsdp", "muon router whole", comm_moe.moe_layers_held(c, stages),
                           padded_numel([(p.rows, p.cols)], c.shard * c.tp) * FP32) for [p] in router_units(c)]  # fmt: skip
    return out


def expert_step_bytes(c, stages: list[int], shard_rank: int | None) -> int:
    """The experts' step (module doc): whole experts, 5 of the largest stack; owned ones, the
    rows sent, the owned matrices twice (received, orthogonalised) and 5 of the largest batch."""
    if not comm_moe.moe_layers_held(c, stages):
        return 0
    if not experts_split(c):
        return FP32 * 5 * max(math.prod(s) for s in comm_moe.expert_shapes(c)[:2])
    n, (units, mine) = comm_moe.expert_shards(c), owned_experts(c, stages, shard_rank)
    stack = len(units) // comm_moe.moe_layers_held(c, stages) // 2  # E/ep: the experts of one stacked weight
    batches = [sum(units[i].rows * units[i].cols for i in mine if i // stack == s) for s in range(len(units) // stack)]
    owned = sum(units[i].rows * units[i].cols for i in mine)
    return FP32 * (sum(chunk_rows(u.rows, n) * u.cols for u in units) + 2 * owned + 5 * max(batches))


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
    experts = expert_step_bytes(c, stages, shard_rank)  # before the rest
    if not c.fsdp_applied:
        return max(experts, FP32 * 5 * largest)
    owned_tp = sum(p.rows * p.cols for u in mine for p in u)
    rows = sum(chunk_rows(p.rows, c.shard) * p.cols for u in units for p in u)
    return max(experts, FP32 * (owned_tp + sum(wholes) + 2 * rows + 4 * largest))


def muon_collectives(c, stages: list[int], block_shapes, collective, shard_rank: int | None = None) -> list:
    if not c.muon:
        return []
    experts = expert_collectives(c, stages, collective, shard_rank)
    if not c.fsdp_applied:
        units = muon_units(c, stages, block_shapes)
        return experts + [collective("all_gather", "tp", "muon update over tp", 1, whole(p, c.tp) * FP32) for u in units for p in u if p.tp_sharded]
    f = c.shard
    units, mine = owned_units(c, stages, block_shapes, shard_rank)

    def moved(us: list[list[PieceShape]], times: int) -> int:
        return sum(times * chunk_rows(p.rows, f) * p.cols * FP32 for u in us for p in u)

    out = experts
    if f > 1:
        dim = "dp_shard_cp" if c.cp > 1 else "dp_shard"
        out += [collective("all_to_all", dim, "muon update rows to their owners", 1, moved(units, 1)),
                collective("all_to_all", dim, "muon orthogonal rows back", 1, moved(mine, f))]  # fmt: skip
    gathered = sum(whole(p, c.tp) * FP32 for u in mine for p in u if p.tp_sharded)
    if gathered:
        out.append(collective("all_gather", "tp", "muon owned updates over tp", 1, gathered))
    return out
