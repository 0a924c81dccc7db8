"""Megatron's dp_reshardable bucket layout (dtgpt/checkpoint/megatron/buckets.py) on made-up shapes.

megatron-core's own checkpoints of this layout are read in tests/test_megatron_checkpoint.py;
its tiny model's tensors are all multiples of 64 elements and its parameters fill the buckets
exactly, so the alignment and the layouts dtgpt must refuse are shown here, without a launch.
"""

from __future__ import annotations

from dtgpt.checkpoint.megatron.buckets import bucket_layout, fit

BUCKET = "optimizer.distributed.dp_group_idx_{}.gbuf_idx_{}.dtype_(torch.float32, torch.float32).bucket_idx_{}"


def test_parameters_fill_buckets_in_reverse_order_each_aligned_to_64():
    order = [(("a", None), 10), (("b", 0), 100), (("b", 1), 100), (("c", None), 5)]
    # reversed: c at 0, b.1 at 64 (5 -> 64), b.0 at 192 (164 -> 192), a at 320 (292 -> 320)
    assert fit(order, [("one", 330)]) == {("c", None): ("one", 0), ("b", 1): ("one", 64), ("b", 0): ("one", 192), ("a", None): ("one", 320)}
    # the stored lengths say where a bucket closes: c and b.1 fill the first, the next starts at 0
    assert fit(order, [("first", 164), ("second", 138)]) == {
        ("c", None): ("first", 0), ("b", 1): ("first", 64), ("b", 0): ("second", 0), ("a", None): ("second", 128),
    }  # fmt: skip


def test_lengths_that_the_order_cannot_give_are_no_layout():
    order = [(("a", None), 10), (("b", None), 100)]
    assert fit(order, [("one", 110)]) is None  # unaligned: a would start at 128
    assert fit(order, [("one", 100), ("two", 20)]) is None  # a is 10, not 20
    assert fit(order, [("one", 138), ("two", 64)]) is None  # a bucket left over
    assert fit(order, [("one", 100)]) is None  # a parameter left over


def test_layouts_it_does_not_map_say_why():
    def shapes(*buckets):
        return {f"{BUCKET.format(*b)}.{slot}": (128,) for b in buckets for slot in ("param", "exp_avg", "exp_avg_sq")}

    layout, why = bucket_layout(None, shapes((0, 0, 0), (1, 0, 0)), {}, [])
    assert layout is None and why.startswith("it was saved with tensor or pipeline parallelism")
    layout, why = bucket_layout(None, shapes((0, 0, 0), (0, 1, 0)), {}, [])
    assert layout is None and why.startswith("it holds several grad buffers")
    model = {"embedding.word_embeddings.weight": (4, 16), "decoder.layers.self_attention.linear_v.weight": (2, 8, 8)}
    layout, why = bucket_layout(None, {**shapes((0, 0, 0)), **model}, {}, list(model))
    assert layout is None and why.startswith("its buckets do not match megatron-core's parameter order")
