"""An MoE model's Adam state saved by megatron-core at tp 2, in Megatron's dp_reshardable layout.

megatron-core's distributed optimizer on its MoE GPTModel (tests/megatron_moe_gpt.py's: 4
SequentialMLP experts, a SwiGLU shared expert and its gate) after one synthetic step at tp 2,
saved in the 4-rank launch that also saves the dense model at tp 2 x pp 2 (conftest.adam_tp2pp2,
tests/megatron_moe_adam.py's TP2_LAYOUTS): the experts whole on each tp rank (expert tp 1) or split
as the dense MLP (expert tp = tp, Megatron's default), in the dense buffers (ep 1) or in their own
(ep 2). Each dp_reshardable save is read against megatron-core's model-space save of the same state.
"""

from __future__ import annotations

import pytest
import torch

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.megatron.keys import full_model_shapes, is_buffer
from dtgpt.checkpoint.megatron.reader import MegatronReader
from tests.megatron_gpt import ITERATION
from tests.megatron_moe_adam import TP2_LAYOUTS
from tests.megatron_moe_gpt import EXPERT_FFN
from tests.test_megatron_moe_checkpoint import MODEL, assert_steps_on_alike, model_cfg

ROWS_TP2 = 128  # the vocabulary padded to a multiple of 16 x tp
MODEL_TP2 = {**MODEL, "make_vocab_size_divisible_by": 32}
FC1 = ("decoder.layers.mlp.experts.experts.linear_fc1.weight", 1)


@pytest.mark.slow
@pytest.mark.parametrize("etp, ep", TP2_LAYOUTS)
def test_moe_adam_state_saved_at_tp2_reads_as_megatron_gathers_it(adam_tp2pp2, etp, ep):
    """Tensor by tensor and slot by slot, bit for bit as megatron-core's model-space save: the
    shared expert from each tp rank's shard, the router from tp rank 0's copy, each routed
    expert from the buffer that holds it (the dense ones at ep 1, chained_1 of expert
    model-parallel rank etp rank + etp x ep rank at ep 2), whole or as its expert tp shards."""
    saved = adam_tp2pp2 / "moe_tp2" / f"etp{etp}_ep{ep}"
    shapes = full_model_shapes(model_cfg(**MODEL_TP2), ROWS_TP2)
    buckets = MegatronReader(layout.iteration_dir(saved / "dp_reshardable", ITERATION))
    gathered = MegatronReader(layout.iteration_dir(saved, ITERATION))
    for reader in (buckets, gathered):
        reader.check(shapes, list(shapes))
    found, spec = buckets.bucket_layout()
    assert spec == "local" and found.experts == "SequentialMLP"
    # expert 3 of 4: ep rank 1's at ep 2; at expert tp 2 its fc1 is 2 shards of [gate; up] rows
    fc1 = sorted((piece.offsets, piece.prefix.split(".gbuf")[0]) for piece in found.pieces[FC1] if piece.offsets[0] == 3)
    buffer = "chained_1.optimizer.distributed.dp_group_idx_{}" if ep == 2 else "optimizer.distributed.dp_group_idx_{}"
    rank = lambda tp_rank: tp_rank + etp * (ep - 1) if ep == 2 else tp_rank  # noqa: E731
    half = EXPERT_FFN // etp
    expected = [((3, 0, 0), buffer.format(rank(0)))] if etp == 1 else [
        ((3, (gate_or_up * 2 + tp_rank) * half, 0), buffer.format(rank(tp_rank))) for gate_or_up in range(2) for tp_rank in range(2)]
    assert fc1 == sorted(expected)
    for name, shape in shapes.items():
        for slot in ("param", "exp_avg", "exp_avg_sq") if not is_buffer(name) else ():
            assert torch.equal(buckets.tensor(name, shape, slot), gathered.tensor(name, shape, slot)), (name, slot)


@pytest.mark.slow
@pytest.mark.parametrize("etp, ep", [(1, 1), (2, 2)])
def test_moe_adam_state_saved_at_tp2_steps_on_as_its_model_space_save(adam_tp2pp2, etp, ep, capsys):
    """One dtgpt step (one process, AdamW, clipped) from the buckets equals one from the
    model-space save: weights and both moments, bit for bit."""
    assert_steps_on_alike(adam_tp2pp2 / "moe_tp2" / f"etp{etp}_ep{ep}", MODEL_TP2, capsys)
