"""dtgpt's Muon state as megatron-core 0.16.1's Muon chain saves it in torch_dist (load.py reads
the same back).

get_megatron_muon_optimizer builds a ChainedOptimizer of its TensorParallelMuon (the matrices) and
its Adam (the rest), each an FP32Optimizer (bf16: Float16OptimizerWithFloat16Params), never the
distributed optimizer; Megatron-LM saves it with chained_optim_avoid_prefix, so the tensors are in
model space under the parameters' keys, and common.pt holds each chained optimizer's param groups:

    optimizer.state.momentum_buffer.<key>   Muon's momentum of a matrix (dtgpt's, SwiGLU's gate
                                            and fc1 rows concatenated as linear_fc1)
    optimizer.state.exp_avg(_sq).<key>      Adam's moments of the rest
    optimizer.state.fp32_param.<key>        under bf16, the fp32 master weights (dtgpt's parameters)
    common.pt optimizer                     {0: Muon's param groups, 1: Adam's, with its step as
                                            state.common_step}

An MoE model's experts would be a third chained optimizer (Muon's for the experts): not written.
"""

from __future__ import annotations

import torch

from dtgpt.checkpoint.megatron.keys import MOMENTS, MOMENTUM
from dtgpt.config import OptimizerConfig
from dtgpt.config.decoupled_lr_rules import embedding_output_bounds



def muon_sources(name: str, stored: set[str], bf16: bool) -> dict[str, str]:
    """Megatron optimizer slot -> the dtgpt checkpoint key it is written from, for parameter
    `name` of a Muon run whose checkpoint holds the keys `stored`."""
    muon = f"optimizer.state.{name}.{MOMENTUM}" in stored
    sources = {slot: f"optimizer.state.{name}.{slot}" for slot in ((MOMENTUM,) if muon else MOMENTS)}
    return sources | ({"fp32_param": f"model.{name}"} if bf16 else {})


def megatron_muon_common(cfg: OptimizerConfig, step: float) -> dict:
    """What megatron-core's Muon chain keeps in common.pt: its Muon's one param group (the
    matrices, weight decay on) and its Adam's (the word embedding and output layer, at
    decoupled_lr where set, then the biases and norms without weight decay), told apart by
    wd_mult and is_decoupled_lr as megatron-core's loader matches them, with Adam's step."""
    def group(wd_mult: float, max_lr: float, min_lr: float, default: bool, **optimizer) -> dict:
        return {"is_expert_parallel": False, "default_config": default, "wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False,
                "max_lr": max_lr, "min_lr": min_lr, "lr": max_lr, "weight_decay": cfg.weight_decay * wd_mult, **optimizer}  # fmt: skip

    adam = dict(betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, amsgrad=False, maximize=False, foreach=None,
                capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True)  # fmt: skip
    decoupled = cfg.decoupled_lr is not None
    groups = [group(1.0, *embedding_output_bounds(cfg), not decoupled, **adam), group(0.0, cfg.lr, cfg.min_lr, True, **adam)]
    muon = {"param_groups": [group(1.0, cfg.lr, cfg.min_lr, True, momentum=cfg.muon_momentum)]}
    return {"optimizer": {0: muon, 1: {"state": {"common_step": torch.tensor(step)}, "param_groups": groups}},
            "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}  # fmt: skip
