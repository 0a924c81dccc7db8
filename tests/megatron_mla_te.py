"""megatron-core's multi-latent attention with its parameters held as Transformer Engine's layer
spec holds them, on CPU without Transformer Engine: the oracle for a dp_reshardable checkpoint of
a DeepSeek-style model saved at tp > 1 under that spec (tests/megatron_mla_adam.py).

megatron-core 0.16.1's get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)
builds MLASelfAttention with
- linear_q_down_proj, linear_kv_down_proj: TELinear, which MLASelfAttention builds with
  parallel_mode 'duplicated' (no tp group): the whole weight on every tp rank;
- linear_q_up_proj, linear_kv_up_proj (with qk_layernorm): TELayerNormColumnParallelLinear, whose
  norm weight, `layer_norm_weight` (RMSNorm: no bias), Transformer Engine's LayerNormLinear
  registers before its column-parallel `weight` (rows split over tp), and q_layernorm,
  kv_layernorm IdentityOp;
every module in the local spec's place (linear_proj, then the q projections, then the kv ones);
and a dense layer's linear_fc1 a TELayerNormColumnParallelLinear too, holding the pre-MLP norm
(pre_mlp_layernorm IdentityOp; an MoE layer's stays a module, TENorm).
to_transformer_engine_placement turns a local-spec model into that layout in place: each
down-projection's row shards gathered into one whole weight, each compressed vector's norm moved
into its up-projection and a dense layer's pre-MLP norm into its linear_fc1, before the weight. megatron-core's own DDP and distributed optimizer then
lay out the buffers and save them as they would a Transformer Engine model's. No forward runs
(tests/megatron_adam.py's synthetic_step makes the gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DuplicatedLinear(torch.nn.Module):
    """Stands for TELinear(parallel_mode='duplicated'): one whole weight on every tp rank,
    replicated in the checkpoint (megatron-core's default sharded_state_dict of a plain module)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


class LayerNormColumnParallelLinear(torch.nn.Module):
    """Stands for TELayerNormColumnParallelLinear: the norm's weight, whole on every tp rank,
    registered before the column-parallel weight (this rank's rows)."""

    def __init__(self, norm_weight: torch.nn.Parameter, weight: torch.nn.Parameter):
        super().__init__()
        self.layer_norm_weight = norm_weight
        self.weight = weight

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets)


def gathered_rows(shard: torch.Tensor) -> torch.Tensor:
    """A column-parallel weight whole: every tp rank's rows, in rank order."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.detach().contiguous(), group=group)
    return torch.cat(shards)


def to_transformer_engine_placement(model) -> None:
    """Every MLASelfAttention and dense MLP of `model` (decoder layers and MTP blocks) as the
    Transformer Engine spec holds their parameters (the module doc); the weights' values are unchanged."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for attention in [m for m in model.modules() if isinstance(m, MLASelfAttention)]:
        for vector in ("q", "kv"):  # assigned in place: each module keeps its place in registration order
            down = getattr(attention, f"linear_{vector}_down_proj")
            setattr(attention, f"linear_{vector}_down_proj", DuplicatedLinear(gathered_rows(down.weight)))
            norm, up = getattr(attention, f"{vector}_layernorm"), getattr(attention, f"linear_{vector}_up_proj")
            setattr(attention, f"linear_{vector}_up_proj", LayerNormColumnParallelLinear(norm.weight, up.weight))
            setattr(attention, f"{vector}_layernorm", IdentityOp())
    for layer in [m for m in model.modules() if isinstance(m, TransformerLayer) and type(m.mlp) is MLP]:
        layer.mlp.linear_fc1 = LayerNormColumnParallelLinear(layer.pre_mlp_layernorm.weight, layer.mlp.linear_fc1.weight)
        layer.pre_mlp_layernorm = IdentityOp()
