"""Tensor parallelism as DTensor `parallelize_module` plans (Megatron's column/row split).

Per block: QKV and MLP-in (with SwiGLU its gate too) are column-parallel, attention-out and MLP-out row-parallel, so each
block costs one all-reduce in forward (or, with sequence parallelism, one all-gather before and
one reduce-scatter after each sub-layer). The word embedding is vocabulary-parallel, the output
head column-parallel over the vocabulary; with loss parallelism the cross-entropy runs on the
vocabulary-sharded logits without gathering them. Multi-latent attention has its own plan
(dtgpt/parallel/tensor_mla.py).

Every parameter becomes a DTensor on the tp mesh, replicated ones included, so that FSDP and
the gradient-norm computation see one uniform mesh and never count a replica twice.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from dtgpt.mla import MLASelfAttention
from dtgpt.model import GPT, Attention
from dtgpt.moe.layer import MoELayer
from dtgpt.parallel.local_replica import LocalReplicaParallel
from dtgpt.parallel.vocab_parallel import VocabParallelEmbedding
from dtgpt.parallel.tensor_mla import mla_plan


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over tp as DTensors; the module takes and returns local tensors.

    No stock style does this: norms without sequence parallelism and the position table must be
    DTensors (for FSDP and the norm) while the activations around them stay plain replicated
    tensors. Their gradients come out identical on every tp rank, as Replicate.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False) if isinstance(x, torch.Tensor) else x
                for x in inputs
            )

        def to_local(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


class GatheredColwiseParallel(ColwiseParallel):
    """Column parallel, its output gathered whole on every rank (Megatron's QKV with fewer key/value
    groups than tp ranks: each rank then takes its group from it). The gathered output's gradient
    is partial, each rank's from the slices it used: backward reduce-scatters it."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


def _moe_plan(prefix: str, block: nn.Module, tp_mesh: DeviceMesh, folded: bool) -> dict[str, ParallelStyle]:
    """An MoE block's plan under sequence parallelism (config: MoE with tp needs it): the router
    and experts route this rank's chunk of tokens with replicated weights; the shared expert is
    a tensor-parallel MLP like the dense one, its gate (if any) replicated like the router.

    folded: FSDP shards the router and experts over dp x tp (ParallelDims.tp_folds_into_moe), so
    they stay plain parameters here, whole on every tp rank until FSDP takes them.
    """
    # The router's loads over the whole sequences: dtgpt.parallel.expert.apply_moe_sequence_ranks (tp x cp).
    plan: dict[str, ParallelStyle] = {
        prefix + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True),
    }
    shared = block.mlp.shared_expert
    if not folded:
        plan.update({prefix + "mlp.router": LocalReplicaParallel(), prefix + "mlp.experts": LocalReplicaParallel()})
        if block.mlp.shared_expert_gate is not None:  # Megatron's gate: replicated, grads summed over tp as the router's
            plan[prefix + "mlp.shared_expert_gate"] = LocalReplicaParallel()
    if shared is not None:
        plan.update(
            {
                prefix + "mlp.shared_expert": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                prefix + "mlp.shared_expert.fc1": ColwiseParallel(),
                prefix + "mlp.shared_expert.fc2": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
        if shared.gate is not None:
            plan[prefix + "mlp.shared_expert.gate"] = ColwiseParallel()
    return plan


def _own_storage(_module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
    return output.clone() if output._is_view() else output


def _norm_style(sequence_parallel: bool) -> ParallelStyle:
    return SequenceParallel() if sequence_parallel else ReplicateParallel()


def _attention_plan(prefix: str, attention: Attention, tp_mesh: DeviceMesh, seq) -> dict[str, ParallelStyle]:
    """A dense block's attention: QKV column-parallel (gathered when ranks share a group), the
    output projection row-parallel."""
    plan: dict[str, ParallelStyle] = {}
    groups = attention.cfg.query_groups
    qkv_style: ParallelStyle = ColwiseParallel()
    if groups < tp_mesh.size():  # ranks share a group (validation: tp is a multiple of the groups)
        qkv_style = GatheredColwiseParallel()
        attention.shared_group = (tp_mesh.size() // groups, tp_mesh.get_local_rank())
    if attention.q_norm is not None:
        # Each rank normalises its own heads (B, T, nh/tp, hd): sharded on dim 2, so that the
        # weights' gradients are summed over tp like a sequence-parallel norm's.
        for norm in ("q_norm", "k_norm"):
            plan[prefix + "attention." + norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if attention.sink is not None:  # the attention sink's logits of this rank's heads
        plan[prefix + "attention.sink"] = LocalReplicaParallel(Shard(0))
    plan.update(
        {
            prefix + "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            prefix + "attention.qkv": qkv_style,
            prefix + "attention.proj": RowwiseParallel(output_layouts=seq),
        }
    )
    return plan


def _block_plan(
    prefix: str, block: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, moe_folded: bool
) -> dict[str, ParallelStyle]:
    """One transformer block's plan: its attention's, its norms', its MLP's or MoE layer's."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if isinstance(block.attention, MLASelfAttention):
        plan.update(mla_plan(prefix, block.attention, seq))
    else:
        plan.update(_attention_plan(prefix, block.attention, tp_mesh, seq))
    plan[prefix + "input_norm"] = _norm_style(sequence_parallel)
    plan[prefix + "mlp_norm"] = _norm_style(sequence_parallel)
    if isinstance(block.mlp, MoELayer):
        return plan | _moe_plan(prefix, block, tp_mesh, moe_folded)
    if block.mlp.gate is not None:
        plan[prefix + "mlp.gate"] = ColwiseParallel()
    plan.update(
        {
            prefix + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            prefix + "mlp.fc1": ColwiseParallel(),
            prefix + "mlp.fc2": RowwiseParallel(output_layouts=seq),
        }
    )
    return plan


def apply_tp(
    model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool, moe_folded: bool = False,
    local_replicas: bool = False,
) -> None:
    """Shard `model` (a whole GPT or one pipeline stage of it) over `tp_mesh` in place.

    moe_folded: leave the MoE routers and experts to FSDP over dp x tp (see _moe_plan).
    local_replicas: leave the modules ReplicateParallel would wrap plain (their parameters
    plain tensors): for a compute copy (dtgpt/parallel/compute_copy.py), whose fp32 masters are
    the DTensors that the optimizer, the norm and checkpoints see. Such a module takes and
    returns plain replicated tensors either way; plain, it runs without DTensor's dispatch."""
    seq = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    plan: dict[str, ParallelStyle] = {}
    if model.embedding is not None:
        plan["embedding.word"] = VocabParallelEmbedding(output_layouts=Replicate())
        if model.embedding.position is not None:
            plan["embedding.position"] = ReplicateParallel()
        if sequence_parallel:
            # Positions are added to the full sequence; then each rank keeps its chunk (no comm).
            plan["embedding"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = _norm_style(sequence_parallel)
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    for name, block in model.layers.items():
        plan.update(_block_plan(f"layers.{name}.", block, tp_mesh, sequence_parallel, moe_folded))
    if model.mtp is not None:
        for k, layer in enumerate(model.mtp.layers):
            prefix = f"mtp.layers.{k}."
            for norm in ("enorm", "hnorm", "final_layernorm"):
                plan[prefix + norm] = _norm_style(sequence_parallel)
            # Megatron's column-parallel eh_proj, its output gathered whole (then this rank's chunk under SP)
            plan[prefix + "eh_proj"] = ColwiseParallel(input_layouts=seq, output_layouts=seq)
            plan.update(_block_plan(prefix + "transformer_layer.", layer.transformer_layer, tp_mesh, sequence_parallel, moe_folded))
    if local_replicas:
        plan = {name: style for name, style in plan.items() if not isinstance(style, ReplicateParallel)}
    parallelize_module(model, tp_mesh, plan)
    if sequence_parallel and model.embedding is not None:
        # The sequence chunk is a view of the full embedding output. FSDP2 hooks its backward
        # on the module's output and (rightly) distrusts views, which an in-place op later could
        # detach from the hook; a copy of one (B, T/tp, h) chunk makes the output its own tensor.
        model.embedding.register_forward_hook(_own_storage)
    if model.tied and model.embedding is not None and model.output is not None:
        # Both are sharded Shard(0) over the vocabulary; re-tie to the one distributed parameter.
        model.output.weight = model.embedding.word.weight
