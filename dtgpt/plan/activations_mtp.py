"""The activation memory of multi-token prediction (dtgpt/mtp.py), on the last pipeline stage.

Each prediction module runs per micro-batch what the model's end runs once more: the embedding
of the shifted tokens, two norms, a projection of their concatenation, one transformer block of
the last block's kind, a final norm, the shared head and its logits. Korthikanti's method (every
tensor autograd saves, counted once) applied to it, per module, micro-batch and rank:

term (kept by)                                  bytes               under tp t (dtgpt's plan)
embedding dropout mask                          s·b·h               as the model's; none at p = 0
enorm input (the shifted tokens' embedding)     r·s·b·h             /t with SP
hnorm input (the depth before's normed output)  e·s·b·h             only with dtgpt's SP, /t: otherwise
                                                                    the same tensor the head keeps
eh_proj input ([enorm output, hnorm output])    2·e·s·b·h           as a column-parallel input
the block                                       layer_activation_terms (its kind: the last block's)
final norm input, head input, logits            head_activation_terms

The block's recomputation is selective's where the model's is (its attention core is
recomputed); full recomputation groups the model's blocks only, so the module's block keeps
everything. tests/test_activation_memory.py measures the saved tensors of real modules against it.
"""

from __future__ import annotations

from dtgpt.plan.activations import ActivationShape, embedding_activation_bytes, head_activation_terms, layer_activation_terms


def mtp_activation_terms(shape: ActivationShape, recompute: str = "none", *, moe: bool = False) -> dict[str, float]:
    """Bytes one prediction module keeps for backward per micro-batch on one rank, by term."""
    e, r = shape.compute_bytes, shape.residual_bytes or shape.compute_bytes
    terms = {
        "embedding dropout mask": embedding_activation_bytes(shape),
        "enorm input": r * shape.sbh / shape.sp_divisor,
        "eh_proj input": 2 * e * shape.sbh / shape.gathered_divisor,
    }
    if shape.sp and not shape.megatron_sp:  # the head keeps the gathered input, not the norm's chunk
        terms["hnorm input"] = e * shape.sbh / shape.sp_divisor
    terms.update({f"block: {name}": v for name, v in layer_activation_terms(shape, recompute, moe=moe).items()})
    terms.update(head_activation_terms(shape))
    return terms


def mtp_activation_bytes(shape: ActivationShape, depth: int, recompute: str = "none", *, moe: bool = False) -> float:
    """The `depth` prediction modules' bytes per micro-batch on one rank of the last stage."""
    return depth * sum(mtp_activation_terms(shape, recompute, moe=moe).values())
