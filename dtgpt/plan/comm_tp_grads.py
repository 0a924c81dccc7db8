"""The gradients of the weights tp replicates while each tp rank computes on its own tokens
(dtgpt.plan.comm): norm weights under sequence parallelism (the prediction modules' too), qk-norms (each rank its own heads),
multi-latent attention's down-projections and their norms, an MoE layer's router and experts.
Each rank's gradient is a partial sum over tp.

Under FSDP its post-backward all-reduces each over tp, once per iteration, in the gradient's
dtype (the compute dtype with one micro-batch, else the reduce dtype it accumulates in), except
the MoE layers', whose units fold tp in (dtgpt.plan.comm_moe). Without FSDP (dp = cp = 1: fp32,
or a compute copy's fp32 masters under fp16/bf16) all of them are summed in one all-reduce per
iteration, in the dtype gradients are reduced in (dtgpt/parallel/grad_bucket.py).
"""

from __future__ import annotations

from dtgpt.plan import comm_mla, comm_moe, comm_mtp

# `c` is a dtgpt.plan.comm.CommLayout and `collective` its Collective class (comm imports this module).


def replicated_grad_collectives(c, stages: list[int], n_micro: int, collective) -> list:
    blocks = sum(c.layer_counts[s] for s in stages) + comm_mtp.mtp_blocks(c, stages)
    last = c.num_stages - 1 in stages
    pending = []  # (what, tensors, elements each)
    if c.sequence_parallel:  # each block's two norms, the final norm, each prediction module's three
        norms = 2 * blocks + (1 if last else 0) + 3 * comm_mtp.mtp_blocks(c, stages)
        pending.append(("sp norm weight grads", norms * c.norm_params, c.hidden))
    if c.qk_norm and c.latent is None:
        pending.append(("qk norm weight grads", 2 * blocks * c.norm_params, c.head_dim))
    if c.latent is not None:  # multi-latent attention's replicated down-projections and their norms
        pending += [("mla replicated weight grads", blocks, numel) for numel in comm_mla.replicated_grad_elements(c)]
    if c.fsdp_applied:
        grad = c.grad_bytes if n_micro > 1 else c.compute_bytes
        return [collective("all_reduce", "tp", what, count, numel * grad) for what, count, numel in pending]
    bucket = sum(count * numel for _, count, numel in pending) + comm_moe.replicated_numel(c, stages)
    return [collective("all_reduce", "tp", "pending tp grad sums, one bucket", 1, bucket * c.grad_bytes)] if bucket else []
