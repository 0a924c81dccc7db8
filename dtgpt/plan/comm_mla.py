"""Multi-latent attention's share of the collectives (dtgpt/mla.py under dtgpt/parallel/tensor_mla.py's
plan), per rank and iteration, in place of the (grouped-query) attention's in plan/comm.py:

  tp with SP    the attention's input is not gathered: the down-projections run on the rank's own
                tokens; the compressed query (q_lora wide, or the hidden state h wide without one),
                the compressed key/value (kv_lora) and the shared RoPE key (pos) are all-gathered
                for the up-projections, and their gradients reduce-scattered: 3 of each per block
                and micro-batch, where the attention had one h wide
  tp without SP the input gradients of the up-projections reach the compressed vectors partial:
                2 all-reduces (q_lora, kv_lora + pos) per block and micro-batch, where the
                attention had one (h)
  tp, either    the replicated down-projections and the norms after them: their gradients summed
                over tp once per iteration (4 all-reduces per block; in place of the qk-norms')
  cp            the keys (heads·(qk + pos)) and values (heads·v) of this rank's heads gathered
  FSDP          the block's own tp-local shapes (block_shapes)

tests/test_comm_counts.py counts them on real ranks (the mla_ layouts of tests/comm_counts.py,
with a compressed query; without one, linear_q_proj's gathered input is taken to be the hidden
state, which no count has checked yet).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Latent:
    """Multi-latent attention's widths: q_lora (0: the query projected in one), kv_lora, pos (the
    shared RoPE key), qk and v per head, and whether the compressed vectors are normed."""

    q_lora: int
    kv_lora: int
    pos: int
    qk: int
    v: int
    norms: bool

    @classmethod
    def of(cls, m) -> "Latent | None":
        if not m.multi_latent_attention:
            return None
        return cls(m.q_lora_rank or 0, m.kv_lora_rank, m.qk_pos_emb_head_dim, m.qk_head_dim, m.v_head_dim, m.qk_layernorm)


def attention_shapes(c) -> list[tuple[int, ...]]:
    """One block's tp-local attention parameter shapes: replicated down-projections and norms,
    column-parallel up-projections (heads split), the row-parallel output projection."""
    lat, h, tp = c.latent, c.hidden, c.tp
    heads = c.heads // tp
    if lat.q_lora:
        query = [(lat.q_lora, h)] + [(lat.q_lora,)] * (c.norm_params * lat.norms) + [(heads * (lat.qk + lat.pos), lat.q_lora)]
    else:
        query = [(heads * (lat.qk + lat.pos), h)]
    kv = [(lat.kv_lora + lat.pos, h)] + [(lat.kv_lora,)] * (c.norm_params * lat.norms) + [(heads * (lat.qk + lat.v), lat.kv_lora)]
    return query + kv + [(h, heads * lat.v)] + [(h,)] * c.bias


def replicated_grad_elements(c) -> list[int]:
    """The elements of each replicated attention parameter whose gradient tp sums."""
    lat, h = c.latent, c.hidden
    shapes = ([lat.q_lora * h] + [lat.q_lora] * (c.norm_params * lat.norms)) if lat.q_lora else []
    return shapes + [(lat.kv_lora + lat.pos) * h] + [lat.kv_lora] * (c.norm_params * lat.norms)


def latent_tp_collectives(c, collective, blocks: int, n_micro: int) -> list:
    """The attention's tp collectives (`collective`: plan/comm.py's Collective, passed in) for
    `blocks` blocks and `n_micro` micro-batches; none without multi-latent attention."""
    lat = c.latent
    if lat is None:
        return []
    token_bytes = c.micro_batch * c.tokens * c.compute_bytes
    query = lat.q_lora or c.hidden
    n = blocks * n_micro
    if c.sequence_parallel:
        out = [collective("all_gather", "tp", f"mla {what} fwd", n, width * token_bytes)
               for what, width in (("compressed query", query), ("compressed key/value", lat.kv_lora), ("rope key", lat.pos))]
        out += [collective("reduce_scatter", "tp", f"mla {what} grads bwd", n, width * token_bytes)
                for what, width in (("compressed query", query), ("compressed key/value", lat.kv_lora), ("rope key", lat.pos))]
    else:
        out = [collective("all_reduce", "tp", "mla compressed query grads bwd", n, query * token_bytes),
               collective("all_reduce", "tp", "mla compressed key/value and rope key grads bwd", n,
                          (lat.kv_lora + lat.pos) * token_bytes)]  # fmt: skip
    return out  # the replicated weights' gradient sums: dtgpt.plan.comm_tp_grads


def latent_cp_collectives(c, collective, n_gather: int, n_scatter: int) -> list:
    """The keys' and values' gathers (`n_gather` each) and gradient reduce-scatters (`n_scatter` each)."""
    lat = c.latent
    per_head = c.micro_batch * c.seq * (c.heads // c.tp) * c.compute_bytes
    out = []
    for what, width in (("keys", lat.qk + lat.pos), ("values", lat.v)):
        out += [collective("all_gather", "cp", f"mla {what} fwd", n_gather, width * per_head),
                collective("reduce_scatter", "cp", f"mla {what} grads bwd", n_scatter, width * per_head)]
    return out
