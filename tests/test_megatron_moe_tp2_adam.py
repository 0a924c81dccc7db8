"""An MoE model's Adam state saved by megatron-core at tp 2 or pp 2, in Megatron's dp_reshardable layout.

megatron-core's distributed optimizer on its MoE GPTModel (tests/megatron_moe_gpt.py's: 4
SequentialMLP experts, a SwiGLU shared expert and its gate) after one synthetic step, saved in the
4-rank launch that also saves the dense model at tp 2 x pp 2 (conftest.adam_tp2pp2,
tests/megatron_moe_adam.py): at tp 2 (TP2_LAYOUTS), the experts whole on each tp rank (expert tp
1) or split as the dense MLP (expert tp = tp, Megatron's default), in the dense buffers (ep 1) or
in their own (ep 2); at pp 2 (PIPELINE_LAYOUTS), with 2 virtual stages per pp rank (a grad
buffer per model chunk, the experts' too) at ep 1 and 2, and at tp 2 x pp 2 with expert tp 1 and
2. Each dp_reshardable save is read against megatron-core's model-space save of the same state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.megatron.buckets import BucketLayout
from dtgpt.checkpoint.megatron.keys import full_model_shapes, is_buffer
from dtgpt.checkpoint.megatron.reader import MegatronReader
from tests.megatron_gpt import ITERATION
from tests.megatron_moe_adam import PIPELINE_LAYOUTS, TP2_LAYOUTS, experts_apart, pipeline_layout_name
from tests.megatron_moe_gpt import EXPERT_FFN
from tests.test_megatron_moe_checkpoint import MODEL, assert_steps_on_alike, model_cfg

ROWS_TP2, ROWS_TP1 = 128, 112  # the vocabulary padded to a multiple of 16 x tp
MODEL_TP2 = {**MODEL, "make_vocab_size_divisible_by": 32}
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def pipeline_model(tp: int, vp: int | None) -> dict:
    """PIPELINE_LAYOUTS' [model]: 2 layers a virtual stage, the vocabulary rows of its tp."""
    return {**(MODEL_TP2 if tp == 2 else MODEL), "num_layers": 2 * (vp or 1)}


def assert_reads_as_gathered(saved: Path, model: dict, rows: int) -> BucketLayout:
    """Tensor by tensor and slot by slot, saved/dp_reshardable's buckets read bit for bit as
    megatron-core's model-space save under `saved`; the layout found."""
    shapes = full_model_shapes(model_cfg(**model), rows)
    buckets = MegatronReader(layout.iteration_dir(saved / "dp_reshardable", ITERATION))
    gathered = MegatronReader(layout.iteration_dir(saved, ITERATION))
    for reader in (buckets, gathered):
        reader.check(shapes, list(shapes))
    found, spec = buckets.bucket_layout()
    assert found is not None and spec == "local" and found.experts == "SequentialMLP", spec
    for name, shape in shapes.items():
        for slot in ("param", "exp_avg", "exp_avg_sq") if not is_buffer(name) else ():
            assert torch.equal(buckets.tensor(name, shape, slot), gathered.tensor(name, shape, slot)), (name, slot)
    return found


def holders(found: BucketLayout, layer: int, expert: int) -> list[tuple]:
    """(offsets, grad buffer: optimizer, dp group index, gbuf index) of each piece of one expert's fc1 in one layer."""
    return sorted((piece.offsets, piece.prefix.split(".dtype_")[0]) for piece in found.pieces[(FC1, layer)] if piece.offsets[0] == expert)


@pytest.mark.slow
@pytest.mark.parametrize("etp, ep", TP2_LAYOUTS)
def test_moe_adam_state_saved_at_tp2_reads_as_megatron_gathers_it(adam_tp2pp2, etp, ep):
    """The shared expert from each tp rank's shard, the router from tp rank 0's copy, each routed
    expert from the buffer that holds it (the dense ones at ep 1 but where experts_apart, chained_1 of expert
    model-parallel rank etp rank + etp x ep rank at ep 2), whole or as its expert tp shards."""
    found = assert_reads_as_gathered(adam_tp2pp2 / "moe_tp2" / f"etp{etp}_ep{ep}", MODEL_TP2, ROWS_TP2)
    # expert 3 of 4: ep rank 1's at ep 2; at expert tp 2 its fc1 is 2 shards of [gate; up] rows
    buffer = ("chained_1." if experts_apart(ep, etp, 2) else "") + "optimizer.distributed.dp_group_idx_{}.gbuf_idx_0"
    rank = lambda tp_rank: tp_rank + etp * (ep - 1) if ep == 2 else tp_rank  # noqa: E731
    half = EXPERT_FFN // etp
    expected = [((3, 0, 0), buffer.format(rank(0)))] if etp == 1 else [
        ((3, (gate_or_up * 2 + tp_rank) * half, 0), buffer.format(rank(tp_rank))) for gate_or_up in range(2) for tp_rank in range(2)]
    assert holders(found, 1, 3) == sorted(expected)


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, etp, vp, ep", PIPELINE_LAYOUTS)
def test_moe_adam_state_saved_at_pp2_reads_as_megatron_gathers_it(adam_tp2pp2, name, tp, etp, vp, ep):
    """At pp 2 each routed expert of layer l comes from the buffer of l's stage: with virtual
    stages, gbuf_idx c of pp rank r holds virtual stage c x pp + r (layer 2 of 4 in chunk 1 of pp
    rank 0), in chained_1 of expert model-parallel rank etp rank + etp x (ep rank + ep x pp rank)
    at ep 2, in the dense buffer of model-parallel rank tp rank + tp x pp rank at ep 1."""
    found = assert_reads_as_gathered(adam_tp2pp2 / pipeline_layout_name(name, etp, ep), pipeline_model(tp, vp), ROWS_TP2 if tp == 2 else ROWS_TP1)
    layer = 2 if vp else 1  # chunk 1 of pp rank 0 with virtual stages; pp rank 1 without
    pp_rank, chunk = (0, 1) if vp else (1, 0)
    buffer = ("chained_1." if ep == 2 else "") + "optimizer.distributed.dp_group_idx_{}.gbuf_idx_" + str(chunk)
    rank = lambda tp_rank: tp_rank + etp * (1 + ep * pp_rank) if ep == 2 else tp_rank + tp * pp_rank  # noqa: E731  (expert 3: ep rank 1)
    half = EXPERT_FFN // etp
    expected = [((3, 0, 0), buffer.format(rank(0)))] if etp == 1 else [
        ((3, (gate_or_up * 2 + tp_rank) * half, 0), buffer.format(rank(tp_rank))) for gate_or_up in range(2) for tp_rank in range(2)]
    assert holders(found, layer, 3) == sorted(expected)


@pytest.mark.slow
@pytest.mark.parametrize("etp, ep", [(1, 1), (2, 2)])
def test_moe_adam_state_saved_at_tp2_steps_on_as_its_model_space_save(adam_tp2pp2, etp, ep, capsys):
    """One dtgpt step (one process, AdamW, clipped) from the buckets equals one from the
    model-space save: weights and both moments, bit for bit."""
    assert_steps_on_alike(adam_tp2pp2 / "moe_tp2" / f"etp{etp}_ep{ep}", MODEL_TP2, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, etp, vp, ep", PIPELINE_LAYOUTS)
def test_moe_adam_state_saved_at_pp2_steps_on_as_its_model_space_save(adam_tp2pp2, name, tp, etp, vp, ep, capsys):
    """The same from each save at pp 2: with virtual stages, and at tp 2 x pp 2."""
    assert_steps_on_alike(adam_tp2pp2 / pipeline_layout_name(name, etp, ep), pipeline_model(tp, vp), capsys)
