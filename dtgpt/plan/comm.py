"""The communication model: every collective one rank runs in one training iteration.

One formula per collective, written once, used by the planner (bytes and time for the 175B
layout) and checked by tests/test_comm_counts.py against the collectives a profiler counts on
real gloo ranks. docs/performance.md states the same formulas in words.

Sizes are *message* bytes: the whole tensor a collective produces or consumes (an all-gather's
output, a reduce-scatter's input, an all-reduce's or a send's tensor), as nccl-tests reports
"size". `link_bytes` turns them into what a ring moves per rank.

With b the micro-batch size, s the sequence length, h the hidden size, n the micro-batches per
iteration, e the compute bytes (2 in fp16/bf16, 4 in fp32: the model computes in its dtype,
dtgpt/parallel/fsdp.py), g the gradient-reduction bytes (4, or 2 for fp16 without
accumulate_allreduce_grads_in_fp32), per rank and iteration (under cp, every activation size
below counts the rank's s/cp tokens):

  FSDP (dp x cp > 1)  FSDP shards over dp_shard x cp; per unit: 1 all-gather of its gathered
                 parameters (e bytes each: cast before the gather) and 1 reduce-scatter of its
                 gradients (g bytes), HSDP adds 1 all-reduce of the g-byte shard over
                 dp_replicate. Once per iteration: gradient sync is off and the parameters stay
                 gathered until the last micro-batch ('always' resharding: 2 all-gathers per
                 unit per micro-batch, the root unit's 1).
  CP  per block per micro-batch: 2 all-gathers (keys and values) of b·s·g·d/tp·e (g key/value
                 groups of d channels; g·d = h without grouped-query attention) forward, again
                 where backward recomputes the attention core, and 2 reduce-scatters of their
                 gradients backward.
  TP  per block per micro-batch: without SP 2 all-reduces forward and 2 backward; with SP 2
                 all-gathers and 2 reduce-scatters each way; all of b·s·h·e. The embedding adds
                 an all-reduce forward (and with SP an all-gather backward), the head an
                 all-reduce backward (SP: an all-gather forward, a reduce-scatter backward),
                 the vocabulary-parallel loss 2 all-reduces: the max (b·s fp32), the sum of exp
                 with the target logit (2·b·s fp32; Megatron's 3 of b·s). With SP each replicated norm weight's gradient: 1 all-reduce of
                 h elements per iteration (g bytes each, e with a single micro-batch) under FSDP;
                 without it, all such pending sums (and the MoE router's and experts') in 1
                 all-reduce per iteration.
  recomputation  a recomputed forward's collectives again: dtgpt.plan.comm_recompute.
  PP  per micro-batch and held stage: 1 send and 1 recv of b·(s/tp under SP)·h·e forward (fp32
                 with fp32_residual_connection), the same backward, except at either end.
  Muon           its matrices' updates to their owner and back, and over tp: dtgpt.plan.comm_muon.
  MoE, MTP       the experts' all-to-all over ep, their FSDP units over efsdp, and under tp the
                 units that fold tp in: dtgpt.plan.comm_moe; multi-token prediction: comm_mtp.
  per iteration  the split tied embedding: 1 all-reduce of its local gradient (g bytes) on the first
                 and last stage; the loss's token count over dp x cp (last stage); the loss with the
                 squared gradient norm: 1 all-reduce of 2 fp32 over the world (a non-finite norm: fp16's overflow).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dtgpt.chunks import chunk_rows, padded_numel
from dtgpt.config import Config, fsdp_reshards_after_forward, grads_reduced_in_fp32, low_precision, mesh_shape
from dtgpt.parallel.pipeline import stage_ids_on_rank, stage_layer_counts
from dtgpt.config.recompute_rules import selective_modules
from dtgpt.plan import comm_embedding, comm_mla, comm_moe, comm_mtp, comm_muon, comm_recompute, comm_tp_grads

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "recv")
FP32 = 4


@dataclass(frozen=True)
class Collective:
    kind: str
    dim: str
    """the mesh dimension it runs over: tp, cp, pp, dp, dp_cp, dp_shard(_cp), dp_replicate, ep, efsdp(_tp), moe_fsdp, tied, world"""
    what: str
    count: int
    message_bytes: int  # bytes of one call's message

    @property
    def bytes(self) -> int:
        return self.count * self.message_bytes


@dataclass(frozen=True)
class CommLayout:
    """What the formulas need: the model, the mesh and the precision of one config."""

    num_layers: int
    hidden: int
    ffn: int
    seq: int
    micro_batch: int
    vocab: int  # the padded vocabulary
    positions: int
    """learned position rows (0 with RoPE)"""
    norm_params: int
    """tensors per norm: 2 for LayerNorm (weight, bias), 1 for RMSNorm"""
    tied: bool
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    sequence_parallel: bool
    loss_parallel: bool
    stages_per_rank: int
    schedule: str
    compute_bytes: int
    grad_bytes: int
    residual_bytes: int
    fp16: bool
    reshard_every_micro_batch: bool
    layer_counts: tuple[int, ...]
    recompute: tuple[str | None, str | None, int | None] = (None, None, None)
    """Megatron's (granularity, method, num_layers), and what 'selective' recomputes (dtgpt.plan.comm_recompute)."""
    recompute_modules: tuple[str, ...] = ()
    dropout: bool = False  # hidden dropout keeps a mask after each sub-layer
    heads: int = 0
    """Query heads, key/value groups and channels per head (GPT-3: groups = heads, head_dim = h / heads)."""
    groups: int = 0
    head_dim: int = 0
    swiglu: bool = False
    bias: bool = True
    """Biases in every linear layer; qkv_bias: in the QKV projection."""
    qkv_bias: bool = True
    qk_norm: bool = False
    experts: int = 0
    """MoE (dtgpt.plan.comm_moe): experts per MoE layer (0: dense), top-k, which blocks, widths."""
    topk: int = 0
    moe_layer_freq: int | str = 1
    expert_ffn: int = 0
    shared_ffn: int = 0
    ep: int = 1
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    load_balancing: str = "none"
    aux_loss_coeff: float = 0.0
    z_loss: bool = False
    shared_gate: bool = False
    per_layer_logging: bool = False
    compiled_tp: bool = False
    latent: "comm_mla.Latent | None" = None
    """Multi-latent attention's widths (dtgpt.plan.comm_mla), None for (grouped-query) attention."""
    mtp: int = 0  # multi-token prediction modules on the last stage (dtgpt.plan.comm_mtp)
    muon: bool = False  # Muon's optimizer step gathers its matrices' updates (dtgpt.plan.comm_muon)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, vocab: int) -> "CommLayout":
        m, t, p = cfg.model, cfg.training, cfg.parallel
        pp, dpr, dps, cp, tp = mesh_shape(cfg, world_size)
        e = 2 if low_precision(cfg) else FP32
        return cls(
            num_layers=m.num_layers, hidden=m.hidden_size, ffn=m.ffn_size, seq=m.seq_length,
            micro_batch=t.micro_batch_size, vocab=vocab,
            positions=m.max_positions if m.position_embedding_type == "learned_absolute" else 0,
            norm_params=1 if m.normalization == "RMSNorm" else 2, tied=not m.untie_embeddings_and_output_weights,
            pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, sequence_parallel=p.sequence_parallel and tp > 1,
            loss_parallel=p.loss_parallel, stages_per_rank=p.virtual_pipeline_stages_per_rank,
            schedule=p.pipeline_schedule, compute_bytes=e, grad_bytes=FP32 if grads_reduced_in_fp32(cfg) else e,
            residual_bytes=FP32 if t.fp32_residual_connection else e, fp16=t.fp16, compiled_tp=t.compile and tp > 1,
            reshard_every_micro_batch=fsdp_reshards_after_forward(cfg),
            layer_counts=tuple(stage_layer_counts(cfg)) if pp > 1 else (m.num_layers,),
            recompute=(t.recompute_granularity, t.recompute_method, t.recompute_num_layers),
            recompute_modules=selective_modules(t), dropout=m.hidden_dropout > 0,
            heads=m.num_attention_heads, groups=m.query_groups, head_dim=m.head_dim, swiglu=m.swiglu,
            bias=m.add_bias_linear, qkv_bias=m.qkv_bias, qk_norm=m.qk_layernorm, latent=comm_mla.Latent.of(m), mtp=m.mtp_depth,
            experts=m.num_experts or 0, topk=m.moe_router_topk if m.moe_enabled else 0, moe_layer_freq=m.moe_layer_freq,
            expert_ffn=m.expert_ffn_size, shared_ffn=m.moe_shared_expert_intermediate_size or 0, shared_gate=m.moe_shared_expert_gate,
            ep=p.expert_model_parallel_size, capacity_factor=m.moe_expert_capacity_factor, per_layer_logging=m.moe_per_layer_logging,
            pad_to_capacity=m.moe_pad_expert_input_to_capacity, load_balancing=m.moe_router_load_balancing_type,
            aux_loss_coeff=m.moe_aux_loss_coeff, z_loss=m.moe_z_loss_coeff is not None, muon=cfg.optimizer.uses_muon,
        )  # fmt: skip

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """FSDP's shard degree: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """The ranks that shard the experts: dp_shard x cp with ep folded out."""
        return self.shard // self.ep

    @property
    def fsdp(self) -> bool:
        return self.dp * self.cp > 1

    @property
    def fsdp_applied(self) -> bool:
        """FSDP wraps the model: dp x cp > 1, or its cast at dp x cp = 1 (dtgpt.parallel.uses_compute_copy)."""
        return self.fsdp or (self.compute_bytes < FP32 and (self.experts > 0 or self.compiled_tp))

    @property
    def tokens(self) -> int:
        """Tokens of a sequence one rank holds."""
        return self.seq // self.cp

    @property
    def num_stages(self) -> int:
        return len(self.layer_counts)


# -- parameters: tp-local shapes, padded for FSDP ----------------------------------------------


def block_shapes(c: CommLayout, moe: bool = False) -> list[tuple[int, ...]]:
    """One block's tp-local parameter shapes (column-parallel split on dim 0, row on dim 1): the
    grouped QKV rows, the projection, the qk-norms, one or (SwiGLU) two MLP inputs, the biases;
    `moe`: the router and shared expert in place of the MLP (the experts are a unit of their own)."""
    h, tp, hd = c.hidden, c.tp, c.head_dim
    norm = [(h,)] * c.norm_params
    qkv = (c.heads + 2 * c.groups) * hd // tp
    attention = [(qkv, h)] + [(qkv,)] * c.qkv_bias + [(h, c.heads * hd // tp)] + [(h,)] * c.bias
    qk_norms = [(hd,)] * (2 * c.norm_params) * c.qk_norm
    if c.latent is not None:  # its norms are among its own shapes
        attention, qk_norms = comm_mla.attention_shapes(c), []
    mlp = comm_moe.moe_block_shapes(c) if moe else comm_moe.mlp_shapes(c, c.ffn)
    return norm + attention + qk_norms + norm + mlp


def embedding_shapes(c: CommLayout) -> list[tuple[int, ...]]:
    return [(c.vocab // c.tp, c.hidden)] + ([(c.positions, c.hidden)] if c.positions else [])


def head_shapes(c: CommLayout, *, with_output: bool) -> list[tuple[int, ...]]:
    return [(c.hidden,)] * c.norm_params + ([(c.vocab // c.tp, c.hidden)] if with_output else [])


def fsdp_units(c: CommLayout, stage: int) -> list[tuple[str, list[tuple[int, ...]], bool]]:
    """(name, tp-local shapes, is root) of each FSDP unit of one stage, as apply_fsdp builds them."""
    first, last = stage == 0, stage == c.num_stages - 1
    units = [("block", block_shapes(c, comm_moe.is_moe_block(c, i)), False) for i in comm_moe.stage_blocks(c, stage)]
    if c.tied and first and last:  # the root keeps the shared weight, and with it the rest
        return comm_mtp.mtp_units(c, stage, units + [("root", embedding_shapes(c) + head_shapes(c, with_output=False), True)], block_shapes)
    if first:
        units.append(("embedding", embedding_shapes(c), False))
    if last:
        units.append(("head", head_shapes(c, with_output=True), False))
    return comm_mtp.mtp_units(c, stage, units, block_shapes)  # a root without the modules holds no parameters: no collective


# -- the collectives ---------------------------------------------------------------------------


def rank_stages(c: CommLayout, pp_rank: int) -> list[int]:
    return stage_ids_on_rank(pp_rank, c.pp, c.stages_per_rank, c.schedule) if c.pp > 1 else [0]


def fsdp_collectives(c: CommLayout, stages: list[int], n_micro: int) -> list[Collective]:
    if not c.fsdp_applied:
        return []
    out = []
    if not c.fsdp:  # one-rank units (fp16/bf16 at dp = cp = 1): only tp-folded MoE units communicate
        return comm_moe.moe_unit_collectives(c, stages, n_micro, Collective)
    dim = "dp_shard_cp" if c.cp > 1 else "dp_shard"
    for stage in stages:
        for name, shapes, root in fsdp_units(c, stage):
            numel = padded_numel(shapes, c.shard)
            gathers = 1
            if c.reshard_every_micro_batch and c.pp == 1:
                gathers = n_micro if root else 2 * n_micro
            out.append(Collective("all_gather", dim, f"fsdp {name} params", gathers, numel * c.compute_bytes))
            out.append(Collective("reduce_scatter", dim, f"fsdp {name} grads", 1, numel * c.grad_bytes))
            if c.dp_replicate > 1:
                shard = numel // c.shard * c.grad_bytes
                out.append(Collective("all_reduce", "dp_replicate", f"hsdp {name} grads", 1, shard))
    return out + comm_moe.expert_fsdp_collectives(c, stages, Collective) + comm_moe.moe_unit_collectives(c, stages, n_micro, Collective)


def tp_collectives(c: CommLayout, stages: list[int], n_micro: int) -> list[Collective]:
    """Every activation and activation gradient is in the compute dtype (a norm returns it even
    from an fp32 residual stream), and so are the norm weights' gradients; the loss's are fp32."""
    if c.tp == 1:
        return []
    act = residual = c.micro_batch * c.tokens * c.hidden * c.compute_bytes
    blocks = sum(c.layer_counts[s] for s in stages) + comm_mtp.mtp_blocks(c, stages)
    moe = comm_moe.moe_layers_held(c, stages)
    shared = moe if c.shared_ffn else 0  # a shared expert is a tensor-parallel MLP
    sublayers = (2 * blocks - moe + shared) * n_micro  # an MoE layer routes the rank's own tokens: no SP around it
    inputs = sublayers - (blocks * n_micro if c.latent is not None else 0)  # MLA reads the rank's own tokens
    out = []
    if c.sequence_parallel:
        out += [Collective("all_gather", "tp", "sp norm outputs fwd", inputs, residual),
                Collective("all_gather", "tp", "sp output grads bwd", sublayers, act),
                Collective("reduce_scatter", "tp", "sp block outputs fwd", sublayers, act),
                Collective("reduce_scatter", "tp", "sp norm output grads bwd", inputs, residual)]  # fmt: skip
    else:
        out += [Collective("all_reduce", "tp", "block outputs fwd", sublayers, act),
                Collective("all_reduce", "tp", "norm output grads bwd", inputs, residual)]  # fmt: skip
    out += comm_mla.latent_tp_collectives(c, Collective, blocks, n_micro)
    if c.groups < c.tp:  # ranks share key/value groups: the QKV output is gathered whole (as Megatron does)
        qkv = c.micro_batch * c.tokens * (c.heads + 2 * c.groups) * c.head_dim * c.compute_bytes
        out += [Collective("all_gather", "tp", "qkv output fwd", blocks * n_micro, qkv),
                Collective("reduce_scatter", "tp", "qkv output grads bwd", blocks * n_micro, qkv)]  # fmt: skip
    out += comm_tp_grads.replicated_grad_collectives(c, stages, n_micro, Collective)
    if 0 in stages:
        out += comm_embedding.embedding_tp_collectives(c, n_micro, Collective)
    out += comm_mtp.mtp_tp_collectives(c, stages, n_micro, Collective)
    if c.num_stages - 1 in stages:
        n_micro = comm_mtp.head_calls(c, n_micro)  # the prediction modules run the head and its loss again
        if c.sequence_parallel:
            out += [Collective("all_gather", "tp", "head input fwd", n_micro, residual),
                    Collective("reduce_scatter", "tp", "head input grad bwd", n_micro, residual)]  # fmt: skip
        else:
            out.append(Collective("all_reduce", "tp", "head input grad bwd", n_micro, residual))
        if c.loss_parallel:
            row = c.micro_batch * c.tokens * FP32  # one fp32 per token
            out += [Collective("all_reduce", "tp", f"vocab-parallel loss {what}", n_micro, k * row) for what, k in (("max", 1), ("sums", 2))]
        else:
            logits = c.micro_batch * c.tokens * c.vocab * c.compute_bytes
            out.append(Collective("all_gather", "tp", "logits fwd", n_micro, logits))
    return out


def cp_collectives(c: CommLayout, stages: list[int], n_micro: int) -> list[Collective]:
    """The attention core gathers keys and values (this rank's heads, the whole sequence) and
    reduce-scatters their gradients; a recomputed core gathers them again."""
    if c.cp == 1:
        return []
    gathered = c.micro_batch * c.seq * c.groups * c.head_dim // c.tp * c.compute_bytes  # this rank's key/value groups
    blocks = sum(c.layer_counts[s] for s in stages)
    rerun = sum(comm_recompute.recomputed_cores(c, s) for s in stages)
    if c.latent is not None:
        return comm_mla.latent_cp_collectives(c, Collective, (blocks + rerun) * n_micro, blocks * n_micro)
    return [
        Collective("all_gather", "cp", "keys and values fwd", 2 * (blocks + rerun) * n_micro, gathered),
        Collective("reduce_scatter", "cp", "key and value grads bwd", 2 * blocks * n_micro, gathered),
    ]


def pp_collectives(c: CommLayout, stages: list[int], n_micro: int) -> list[Collective]:
    """Stages pass the residual stream forward and its gradient back."""
    if c.pp == 1:
        return []
    seq = c.tokens // c.tp if c.sequence_parallel else c.tokens
    act = c.micro_batch * seq * c.hidden * c.residual_bytes
    not_last = sum(1 for s in stages if s != c.num_stages - 1)
    not_first = sum(1 for s in stages if s != 0)
    return [
        Collective("send", "pp", "activations fwd + grads bwd", n_micro * (not_last + not_first), act),
        Collective("recv", "pp", "activations fwd + grads bwd", n_micro * (not_first + not_last), act),
    ]


def step_collectives(c: CommLayout, stages: list[int]) -> list[Collective]:
    """Once per iteration: tied gradients, gradient norm, loss and overflow agreements."""
    first, last = 0 in stages, c.num_stages - 1 in stages
    out = []
    if c.pp > 1 and (c.tied or c.mtp) and first != last:
        rows = chunk_rows(c.vocab // c.tp, c.shard) if c.fsdp else c.vocab // c.tp
        out.append(Collective("all_reduce", "tied", "tied embedding grads", 1, rows * c.hidden * c.grad_bytes))
    if last and c.dp * c.cp > 1:
        out.append(Collective("all_reduce", "dp_cp", "loss tokens", 1, FP32))
    if c.pp * c.dp * c.cp * c.tp > 1:  # each rank's loss part and sum of squares (and MoE routing statistics)
        out.append(Collective("all_reduce", "world", "loss and grad norm", 1, (2 + comm_moe.routing_stats_numel(c) + c.mtp) * FP32))
    return out


def rank_collectives(c: CommLayout, pp_rank: int, n_micro: int, shard_rank: int | None = None) -> list[Collective]:
    """Every collective a rank at pipeline coordinate pp_rank runs in one iteration (Muon's
    depend on its FSDP shard coordinate too: without one, the busiest's)."""
    stages = rank_stages(c, pp_rank)
    return (
        fsdp_collectives(c, stages, n_micro)
        + tp_collectives(c, stages, n_micro)
        + cp_collectives(c, stages, n_micro) + comm_mtp.mtp_cp_collectives(c, stages, n_micro, Collective)
        + pp_collectives(c, stages, n_micro)
        + comm_recompute.tp_replay_collectives(c, stages, n_micro, Collective)
        + comm_moe.all_to_all_collectives(c, stages, n_micro, comm_recompute.rerun_moe_layers(c, stages), Collective)
        + comm_moe.sequence_collectives(c, stages, n_micro, comm_recompute.rerun_moe_layers(c, stages), Collective)
        + comm_muon.muon_collectives(c, stages, block_shapes, Collective, shard_rank)
        + step_collectives(c, stages)
    )


def totals(collectives: list[Collective]) -> dict[str, list[int]]:
    """{kind: [count, message bytes]} (the form the profiler count takes)."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for col in collectives:
        if col.count:
            out[col.kind][0] += col.count
            out[col.kind][1] += col.bytes
    return dict(out)
