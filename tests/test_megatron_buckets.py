"""Megatron's dp_reshardable bucket layout (dtgpt/checkpoint/megatron/buckets.py) on made-up shapes.

megatron-core's own checkpoints of this layout are read in tests/test_megatron_checkpoint_resume.py;
its tiny model's tensors are all multiples of 64 elements and its parameters fill the buckets
exactly, so the alignment, each model-parallel rank's stage and tp shards (on shapes small enough
to count by hand) and the layouts dtgpt must refuse are shown here, without a launch.
"""

from __future__ import annotations

import math

import pytest

from dtgpt.checkpoint.megatron import buckets
from dtgpt.checkpoint.megatron.buckets import PARAM_ALIGNMENT, Parallel, Piece, bucket_layout, fit, rank_pieces, stage_order
from dtgpt.checkpoint.megatron.layer_orders import LAYER_SPECS
from dtgpt.checkpoint.megatron.distrib_optim import bucket_lengths
from dtgpt.checkpoint.megatron.keys import OPTIMIZER_PREFIX
from dtgpt.checkpoint.megatron.reader import MegatronReader

BUCKET = "optimizer.distributed.dp_group_idx_{}.gbuf_idx_{}.dtype_(torch.float32, torch.float32).bucket_idx_{}"


def test_parameters_fill_buckets_in_reverse_order_each_aligned_to_64():
    order = [(("a", None), 10), (("b", 0), 100), (("b", 1), 100), (("c", None), 5)]
    # reversed: c at 0, b.1 at 64 (5 -> 64), b.0 at 192 (164 -> 192), a at 320 (292 -> 320)
    assert fit(order, [("one", 330)]) == {("c", None): ("one", 0), ("b", 1): ("one", 64), ("b", 0): ("one", 192), ("a", None): ("one", 320)}
    # the stored lengths say where a bucket closes: c and b.1 fill the first, the next starts at 0
    assert fit(order, [("first", 164), ("second", 138)]) == {
        ("c", None): ("first", 0), ("b", 1): ("first", 64), ("b", 0): ("second", 0), ("a", None): ("second", 128),
    }  # fmt: skip


def test_a_parameter_with_a_bucket_of_its_own_closes_the_one_before_at_the_next_aligned_place():
    """megatron-core's DDP puts a pipeline's tied embedding (shared_embedding) in a bucket of its
    own: the bucket before it ends where it would have started, aligned; the stored lengths say so."""
    numels = [10, 100, 5, 70]  # a, b, c, d: reversed d at 0, c at 128 (70 -> 128), b at 192, a at 320
    assert bucket_lengths(numels, None) == [330]
    # d alone first; then c at 0, b at 64; a alone: the bucket of c and b closes at 192 (164 aligned)
    assert bucket_lengths(numels, None, frozenset({0, 3})) == [70, 192, 10]
    order = [((key, None), n) for key, n in zip("abcd", numels)]
    assert fit(order, [("d", 70), ("cb", 192), ("a", 10)]) == {
        ("d", None): ("d", 0), ("c", None): ("cb", 0), ("b", None): ("cb", 64), ("a", None): ("a", 0),
    }  # fmt: skip
    # with a bucket size too: c and b reach 100 and close at 164, unaligned, a and d each alone
    assert bucket_lengths(numels, 100, frozenset({0, 3})) == [70, 164, 10]


def test_lengths_that_the_order_cannot_give_are_no_layout():
    order = [(("a", None), 10), (("b", None), 100)]
    assert fit(order, [("one", 110)]) is None  # unaligned: a would start at 128
    assert fit(order, [("one", 100), ("two", 20)]) is None  # a is 10, not 20
    assert fit(order, [("one", 138), ("two", 64)]) is None  # a bucket left over
    assert fit(order, [("one", 100)]) is None  # a parameter left over


def test_layouts_it_does_not_map_say_why():
    def shapes(*buckets):
        return {f"{BUCKET.format(*b)}.{slot}": (128,) for b in buckets for slot in ("param", "exp_avg", "exp_avg_sq")}

    layout, why = bucket_layout(None, shapes((0, 0, 0), (1, 0, 0)), {}, [], None)
    assert layout is None and why == "it was saved by 2 model-parallel ranks and the checkpoint's args do not say its tp and pp"
    layout, why = bucket_layout(None, shapes((0, 0, 0), (1, 0, 0), (2, 0, 0)), {}, [], Parallel(2))
    assert layout is None and why == "it holds the buckets of 3 model-parallel ranks, but its args say tp x pp = 2 x 1"
    layout, why = bucket_layout(None, shapes((0, 0, 0), (0, 1, 0)), {}, [], Parallel())
    assert layout is None and why.startswith("model-parallel rank 0 holds 2 grad buffers where its args give 1 model chunk (mixed")
    virtual = Parallel(1, (1, 1, 1, 1), 1, vp=2)  # pp 2 x 2 virtual stages: two grad buffers on each of two ranks
    layout, why = bucket_layout(None, shapes((0, 0, 0), (0, 1, 0), (1, 0, 0)), {}, [], virtual)
    assert layout is None and why.startswith("model-parallel rank 1 holds 1 grad buffers where its args give 2 model chunks (mixed")
    experts = {f"chained_{i}.{key}": shape for i in (0, 1) for key, shape in shapes((0, 0, 0)).items()}  # the same keys but for the prefix
    layout, why = bucket_layout(None, experts, {}, [], Parallel())  # an experts' optimizer, but no experts in the model
    assert layout is None and why == "it holds optimizer buckets of chained optimizers other than an MoE model's experts'"
    moe = {"decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 8, 8)}
    layout, why = bucket_layout(None, {**experts, **moe}, {}, list(moe), Parallel(1, (), 2))  # ep 2, one expert rank's buckets
    assert layout is None and why == "it holds the experts' buckets of 1 model-parallel ranks, but its args say expert tp x ep x pp = 1 x 2 x 1 for 4 experts"
    # with virtual stages the experts' optimizer holds a buffer per model chunk too
    virtual_experts = {f"chained_{i}.{key}": shape for i in (0, 1) for key, shape in shapes((0, 0, 0), (0, 1, 0), (1, 0, 0)).items()}
    layout, why = bucket_layout(None, {**virtual_experts, **moe}, {}, list(moe), virtual)
    assert layout is None and why.startswith("model-parallel rank 1 holds 1 grad buffers where its args give 2 model chunks (mixed")
    virtual_experts.update({f"chained_0.{BUCKET.format(1, 1, 0)}.{slot}": (128,) for slot in ("param", "exp_avg", "exp_avg_sq")})
    layout, why = bucket_layout(None, {**virtual_experts, **moe}, {}, list(moe), virtual)
    assert layout is None and why.startswith("the experts' model-parallel rank 1 holds 1 grad buffers where its args give 2 model chunks (mixed")
    layout, why = bucket_layout(None, {**experts, **moe}, {}, list(moe), Parallel(1, (), 1, 2))  # expert tp 2 but tp 1
    assert layout is None and why == "its experts are split over expert_tensor_parallel_size=2 ranks at tp 1, which dtgpt does not map (only 1 or tp)"
    model = {"embedding.word_embeddings.weight": (4, 16), "decoder.layers.self_attention.linear_v.weight": (2, 8, 8)}
    layout, why = bucket_layout(None, {**shapes((0, 0, 0)), **model}, {}, list(model), Parallel())
    assert layout is None and why.startswith("its buckets do not match megatron-core's parameter order")
    # an MTP block at pp 2 with a tied head (megatron-core 0.16.1 saves none in torch_dist)
    mtp = {"mtp.layers.0.eh_proj.weight": (16, 32)}
    layout, why = bucket_layout(None, {**shapes((0, 0, 0), (1, 0, 0)), **mtp}, {}, list(mtp), Parallel(1, (1, 1)))
    assert layout is None and why == "its multi-token prediction block was saved at pp 2 with a tied head, whose buckets dtgpt maps at pp 1 or untied only"


def test_each_model_parallel_rank_holds_its_stage_and_its_tp_shards():
    """tp 2 x pp 2, a layer per stage, tied head, SwiGLU: rank M = tp rank + 2 x pp rank holds
    its stage's parameters (the last stage also the tied head's copy, in a bucket of its own), each
    as its tp shard: vocabulary rows, linear_proj's and fc2's columns, fc1's [gate; up] rows."""
    emb, proj, fc1, fc2, norm = ("embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_proj.weight",
                                 "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
                                 "decoder.final_layernorm.weight")  # fmt: skip
    shapes = {emb: (8, 4), proj: (2, 4, 4), fc1: (2, 12, 4), fc2: (2, 4, 6), norm: (4,)}
    # local sizes: emb 4x4=16, proj 4x2=8, fc1 6x4=24, fc2 4x3=12, norm 4, the head's copy 16
    # stage 0, reversed: fc2 at 0, fc1 at 64, proj at 128, emb at 192: one bucket of 208
    # stage 1, reversed: the head's copy alone (16), then norm at 0, fc2 at 64, fc1 at 128, proj at 192: 200
    stored = {0: [[("m0", 208)]], 1: [[("m1", 208)]], 2: [[("h2", 16), ("m2", 200)]], 3: [[("h3", 16), ("m3", 200)]]}
    pieces = rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], stored, Parallel(2, (1, 1)))
    assert pieces == {
        (emb, None): [Piece("m0", 192, (4, 4), (0, 0)), Piece("m1", 192, (4, 4), (4, 0))],
        (proj, 0): [Piece("m0", 128, (4, 2), (0, 0)), Piece("m1", 128, (4, 2), (0, 2))],
        (fc1, 0): [Piece("m0", 64, (3, 4), (0, 0)), Piece("m0", 76, (3, 4), (6, 0)),  # [gate 0-2; up 6-8]
                   Piece("m1", 64, (3, 4), (3, 0)), Piece("m1", 76, (3, 4), (9, 0))],  # [gate 3-5; up 9-11]
        (fc2, 0): [Piece("m0", 0, (4, 3), (0, 0)), Piece("m1", 0, (4, 3), (0, 3))],
        (proj, 1): [Piece("m2", 192, (4, 2), (0, 0)), Piece("m3", 192, (4, 2), (0, 2))],
        (fc1, 1): [Piece("m2", 128, (3, 4), (0, 0)), Piece("m2", 140, (3, 4), (6, 0)),
                   Piece("m3", 128, (3, 4), (3, 0)), Piece("m3", 140, (3, 4), (9, 0))],
        (fc2, 1): [Piece("m2", 64, (4, 3), (0, 0)), Piece("m3", 64, (4, 3), (0, 3))],
        (norm, None): [Piece("m2", 0, (4,), (0,))],  # whole on each tp rank: tp rank 0's copy
    }  # fmt: skip
    # an uneven split (the first stage without a layer) is another layout: these lengths do not fit it
    assert rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], stored, Parallel(2, (0, 2))) is None


def mla_gpt(norms: bool) -> dict[str, tuple[int, ...]]:
    """One multi-latent attention layer (hidden 16, q_lora_rank 6, kv_lora_rank 4 + 2 rope dims,
    heads x head dims 8), untied head; with `norms` the compressed vectors' norms under Transformer
    Engine's names (fused into the up-projections)."""
    attention = {"linear_proj.weight": (16, 8), "linear_q_down_proj.weight": (6, 16), "linear_q_up_proj.weight": (8, 6),
                 "linear_kv_down_proj.weight": (6, 16), "linear_kv_up_proj.weight": (8, 4)}  # fmt: skip
    if norms:
        attention |= {"linear_q_up_proj.layer_norm_weight": (6,), "linear_kv_up_proj.layer_norm_weight": (4,)}
    layer = {"input_layernorm.weight": (16,), **{f"self_attention.{k}": v for k, v in attention.items()}}
    return {"embedding.word_embeddings.weight": (8, 16), **{f"decoder.layers.{k}": (1, *v) for k, v in layer.items()},
            "decoder.final_layernorm.weight": (16,), "output_layer.weight": (8, 16)}  # fmt: skip


def test_transformer_engines_multi_latent_attention_keeps_its_down_projections_whole_on_every_tp_rank():
    """At tp 2 under Transformer Engine's spec (megatron-core 0.16.1: TELinear 'duplicated') each tp
    rank's buffer holds MLA's down-projections whole, read from tp rank 0's copy, and the norms
    fused into the up-projections whole before their row shards; the local spec splits the
    down-projections by rows. Local sizes: vocabulary rows 4 x 16 = 64, linear_proj 16 x 4,
    q_down and kv_down 6 x 16 = 96 (48 split), q_up 4 x 6, kv_up 4 x 4, norms 16, 6, 4."""
    shapes = mla_gpt(norms=True)
    # reversed, each at a multiple of 64: head 0, final norm 64, kv_up 128, its norm 192, kv_down 256,
    # q_up 384, its norm 448, q_down 512, linear_proj 640, input norm 704, embedding 768: 832
    stored = {0: [[("m0", 832)]], 1: [[("m1", 832)]]}
    pieces = rank_pieces(shapes, list(shapes), LAYER_SPECS["transformer_engine"], stored, Parallel(2))
    at = "decoder.layers.self_attention."
    assert pieces[(at + "linear_q_down_proj.weight", 0)] == [Piece("m0", 512, (6, 16), (0, 0))]
    assert pieces[(at + "linear_kv_down_proj.weight", 0)] == [Piece("m0", 256, (6, 16), (0, 0))]
    assert pieces[(at + "linear_q_up_proj.layer_norm_weight", 0)] == [Piece("m0", 448, (6,), (0,))]
    assert pieces[(at + "linear_kv_up_proj.layer_norm_weight", 0)] == [Piece("m0", 192, (4,), (0,))]
    assert pieces[(at + "linear_q_up_proj.weight", 0)] == [Piece("m0", 384, (4, 6), (0, 0)), Piece("m1", 384, (4, 6), (4, 0))]
    assert pieces[(at + "linear_kv_up_proj.weight", 0)] == [Piece("m0", 128, (4, 4), (0, 0)), Piece("m1", 128, (4, 4), (4, 0))]
    assert pieces[(at + "linear_proj.weight", 0)] == [Piece("m0", 640, (16, 4), (0, 0)), Piece("m1", 640, (16, 4), (0, 4))]
    assert pieces[("decoder.layers.input_layernorm.weight", 0)] == [Piece("m0", 704, (16,), (0,))]
    assert rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], stored, Parallel(2)) is None  # the fused norms' names: no local layer


@pytest.mark.parametrize("length,spec,q_down", [(704, "transformer_engine", (6, 16)), (576, "local", (3, 16))])
def test_without_the_fused_norms_the_stored_lengths_tell_the_specs_down_projections_apart(reads, length, spec, q_down):
    """Without qk_layernorm both specs name MLA's parameters alike and register them in one order;
    at tp 2 the down-projections whole (Transformer Engine's: 704 elements a rank) or split (the
    local spec's: 576) tell them apart, whose tp rank 0 holds q_down's first rows."""
    shapes = mla_gpt(norms=False)
    stored = {f"{BUCKET.format(rank, 0, 0)}.{slot}": (length,) for rank in range(2) for slot in ("param", "exp_avg", "exp_avg_sq")}
    layout, found = bucket_layout(None, {**shapes, **stored}, {}, list(shapes), Parallel(2))
    assert found == spec
    assert [piece.shape for piece in layout.pieces[("decoder.layers.self_attention.linear_q_down_proj.weight", 0)]][0] == q_down


def test_an_uneven_pipeline_split_places_each_stages_own_layers():
    """pp 2 with decoder_first_pipeline_num_layers=1 of 3 layers (tp 1, tied head): the first stage
    holds the embedding and layer 0, the last layers 1 and 2, the final norm and the head's copy."""
    emb, proj, norm = "embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_proj.weight", "decoder.final_layernorm.weight"
    shapes = {emb: (8, 4), proj: (3, 4, 4), norm: (4,)}
    # stage 0, reversed: layer 0 at 0, emb at 64: 96; stage 1: the head's copy alone (32), then
    # norm at 0, layer 2 at 64, layer 1 at 128: 144
    stored = {0: [[("s0", 96)]], 1: [[("h1", 32), ("s1", 144)]]}
    assert rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], stored, Parallel(1, (1, 2))) == {
        (emb, None): [Piece("s0", 64, (8, 4), (0, 0))], (proj, 0): [Piece("s0", 0, (4, 4), (0, 0))],
        (proj, 1): [Piece("s1", 128, (4, 4), (0, 0))], (proj, 2): [Piece("s1", 64, (4, 4), (0, 0))],
        (norm, None): [Piece("s1", 0, (4,), (0,))],
    }  # fmt: skip
    assert rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], stored, Parallel(1, (2, 1))) is None


def test_virtual_pipeline_chunks_each_fill_a_grad_buffer_of_their_own():
    """pp 2 with 2 virtual stages per pp rank, a layer each (tp 1, tied head): chunk c of pp rank
    r is virtual stage c x 2 + r, in grad buffer c of rank r. Rank 0 holds the embedding and layer
    0 (chunk 0), layer 2 (chunk 1); rank 1 layer 1 (chunk 0), layer 3, the final norm and the
    head's copy (chunk 1)."""
    emb, proj, norm = "embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_proj.weight", "decoder.final_layernorm.weight"
    shapes = {emb: (8, 4), proj: (4, 4, 4), norm: (4,)}
    # rank 0: [layer 0 at 0, emb at 64: 96], [layer 2: 16]; rank 1: [layer 1: 16], [the head's
    # copy alone (32), then norm at 0, layer 3 at 64: 80]
    stored = {0: [[("a0", 96)], [("a1", 16)]], 1: [[("b0", 16)], [("h", 32), ("b1", 80)]]}
    assert rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], stored, Parallel(1, (1, 1, 1, 1), 1, vp=2)) == {
        (emb, None): [Piece("a0", 64, (8, 4), (0, 0))], (proj, 0): [Piece("a0", 0, (4, 4), (0, 0))],
        (proj, 1): [Piece("b0", 0, (4, 4), (0, 0))], (proj, 2): [Piece("a1", 0, (4, 4), (0, 0))],
        (proj, 3): [Piece("b1", 64, (4, 4), (0, 0))], (norm, None): [Piece("b1", 0, (4,), (0,))],
    }  # fmt: skip
    # another split over the virtual stages is another layout: these lengths do not fit it
    assert rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], stored, Parallel(1, (2, 0, 1, 1), 1, vp=2)) is None


def test_with_virtual_stages_the_experts_buffers_are_one_per_model_chunk_too():
    """pp 2 x 2 virtual stages, a layer each, ep 2 (2 experts, tp 1): the experts' optimizer
    (chained_1) of expert model-parallel rank M = ep rank + 2 x pp rank holds a buffer per model
    chunk, chunk c holding virtual stage c x 2 + pp rank's layer, of its one local expert: expert
    e of layer l in buffer l // 2 of rank e + 2 x (l % 2). Each buffer, reversed: fc2 at 0, fc1 at 64."""
    router, fc1, fc2 = ("decoder.layers.mlp.router.weight", "decoder.layers.mlp.experts.experts.linear_fc1.weight",
                        "decoder.layers.mlp.experts.experts.linear_fc2.weight")  # fmt: skip
    shapes = {router: (4, 2, 4), fc1: (4, 2, 4, 4), fc2: (4, 2, 4, 4), "output_layer.weight": (8, 4)}
    # each chunk's layer's router; the last chunk of pp rank 1 the (untied) head too, at 0, its router at 64
    dense = {0: [[("d0", 8)], [("d2", 8)]], 1: [[("d1", 8)], [("d3", 72)]]}
    experts = {m: [[(f"m{m}.g{c}", 80)] for c in range(2)] for m in range(4)}
    pieces = rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], dense, Parallel(1, (1, 1, 1, 1), 2, vp=2), "SequentialMLP", experts)
    assert pieces[(fc1, 2)] == [Piece("m0.g1", 64, (1, 4, 4), (0, 0, 0)), Piece("m1.g1", 64, (1, 4, 4), (1, 0, 0))]  # pp rank 0, chunk 1
    assert pieces[(fc2, 1)] == [Piece("m2.g0", 0, (1, 4, 4), (0, 0, 0)), Piece("m3.g0", 0, (1, 4, 4), (1, 0, 0))]  # pp rank 1, chunk 0
    assert {layer: found for (key, layer), found in pieces.items() if key == router} == {
        layer: [Piece(f"d{layer}", 64 if layer == 3 else 0, (2, 4), (0, 0))] for layer in range(4)}
    for layer in range(4):
        assert [p.prefix for p in pieces[(fc1, layer)]] == [f"m{e + 2 * (layer % 2)}.g{layer // 2}" for e in range(2)]
    # an expert buffer too short for its chunk's layer: no layout
    experts[3][1] = [("m3.g1", 64)]
    assert rank_pieces(shapes, list(shapes), LAYER_SPECS["local"], dense, Parallel(1, (1, 1, 1, 1), 2, vp=2), "SequentialMLP", experts) is None


def dense_gpt(layers: int, hidden: int = 64) -> dict[str, tuple[int, ...]]:
    """A dense GPT's Megatron shapes (local spec, untied head, biases on the attention output and fc2)."""
    per_layer = {"self_attention.linear_qkv.layer_norm_weight": (hidden,), "self_attention.linear_proj.weight": (hidden, hidden),
                 "self_attention.linear_proj.bias": (hidden,), "self_attention.linear_qkv.weight": (3 * hidden, hidden),
                 "mlp.linear_fc1.layer_norm_weight": (hidden,), "mlp.linear_fc1.weight": (4 * hidden, hidden),
                 "mlp.linear_fc2.weight": (hidden, 4 * hidden), "mlp.linear_fc2.bias": (hidden,)}  # fmt: skip
    return {"embedding.word_embeddings.weight": (256, hidden), **{f"decoder.layers.{k}": (layers, *v) for k, v in per_layer.items()},
            "decoder.final_layernorm.weight": (hidden,), "output_layer.weight": (256, hidden)}  # fmt: skip


def saved_buckets(shapes: dict, parallel: Parallel, spec: str = "local") -> dict[str, tuple[int, ...]]:
    """The dp_reshardable param buckets megatron-core saves for `shapes` at `parallel` (one bucket a rank)."""
    stored = {}
    for stage in range(len(parallel.stage_layers) or 1):
        position = 0
        for _, shape in reversed(stage_order(shapes, list(shapes), LAYER_SPECS[spec], stage, parallel)):
            position = -(-position // PARAM_ALIGNMENT) * PARAM_ALIGNMENT + math.prod(shape)
        for rank in range(parallel.tp):
            stored[f"{BUCKET.format(rank + parallel.tp * stage, 0, 0)}.param"] = (position,)
    return stored


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int, int]]:
    """Every region request the checks make, (stored key, first offset, elements), each answered with zeros."""
    made = []

    def read_regions(directory, requests):
        for key, offsets, target in requests.values():
            made.append((key, offsets[0], target.numel()))
            target.zero_()

    monkeypatch.setattr(buckets, "read_regions", read_regions)
    return made


@pytest.mark.parametrize("layers,parallel", [(2, Parallel()), (16, Parallel(4, (4, 4, 4, 4))), (32, Parallel(8, (2,) * 16))])
def test_the_bucket_check_reads_as_much_whatever_the_layers_tp_and_pp(reads, layers, parallel):
    """The master-weight check compares the final norm and two layers' 1-D tensors, and asks for
    each stored chunk of a bucket (here every 8192 elements, as dp shares) at most once: as many
    requests at 2 layers on one rank as at 32 layers on tp 8 x pp 16, none longer than two chunks,
    not a sample of every tp shard of every stage."""
    shapes, saved = dense_gpt(layers), saved_buckets(dense_gpt(layers), parallel)
    chunks = {key: list(range(0, length, 8192)) for key, (length,) in saved.items()}
    layout, spec = bucket_layout(None, {**shapes, **saved}, {}, list(shapes), parallel, chunks)
    assert layout is not None and spec == "local"
    checked = 1 + 4 * len({0, sum(parallel.stage_layers[:-1])})  # the final norm, 4 per layer
    model, master = [n for key, _, n in reads if not key.endswith(".param")], [r for r in reads if r[0].endswith(".param")]
    assert model == [64] * checked  # one 1-D tensor each
    assert len(master) <= checked and all(n <= 2 * 8192 for _, _, n in master)
    touched = [(key, chunk) for key, start, n in master for chunk in range(start // 8192, (start + n - 1) // 8192 + 1)]
    assert len(touched) == len(set(touched))  # no chunk asked for twice


@pytest.mark.parametrize("layers", [2, 96])
def test_the_model_space_check_reads_as_much_whatever_the_layers(reads, layers):
    """The shifted-state check compares the final norm and layer 0's 1-D tensors, not every tensor's layer 0."""
    reader = MegatronReader.__new__(MegatronReader)
    reader.directory, reader.torch_dist, reader.dtypes, reader._chained, reader._per_layer = None, True, {}, {}, False
    model = dense_gpt(layers)
    reader.shapes = {**model, **{f"{OPTIMIZER_PREFIX}param.{k}": v for k, v in model.items()}}
    assert reader.masters_agree("param")
    assert [n for _, _, n in reads] == [64] * 10  # both sides of the final norm and layer 0's 4 1-D tensors


def test_the_bounded_check_still_tells_the_layer_orders_apart(monkeypatch):
    """Saved under Transformer Engine's order at tp 2 x pp 2, whose buckets have the local order's
    lengths too: the checked 1-D tensors (each valued by the parameter it is) sit elsewhere under
    the local order (the input norm moves past linear_proj), so the local order is refused."""
    shapes, parallel = dense_gpt(4), Parallel(2, (2, 2))
    saved = saved_buckets(shapes, parallel, "transformer_engine")
    stored = {rank: [[(BUCKET.format(rank, 0, 0), saved[f"{BUCKET.format(rank, 0, 0)}.param"][0])]] for rank in range(4)}
    truth = rank_pieces(shapes, list(shapes), LAYER_SPECS["transformer_engine"], stored, parallel)
    label = {param: i for i, param in enumerate(truth)}

    def read_regions(directory, requests):  # each element valued by the parameter that holds it
        for key, offsets, target in requests.values():
            if not key.endswith(".param"):
                target.fill_(label[(key, offsets[0] if target.dim() == 2 else None)])
                continue
            target.fill_(-1)
            for param, found in truth.items():
                for piece in (p for p in found if f"{p.prefix}.param" == key):
                    lo, hi = max(piece.start, offsets[0]), min(piece.start + math.prod(piece.shape), offsets[0] + target.numel())
                    target[lo - offsets[0] : max(lo, hi) - offsets[0]] = label[param]

    monkeypatch.setattr(buckets, "read_regions", read_regions)
    assert bucket_layout(None, {**shapes, **saved}, {}, list(shapes), parallel)[1] == "transformer_engine"


def moe_gpt(layers: int, experts: int, hidden: int = 16) -> dict[str, tuple[int, ...]]:
    """An MoE GPT's Megatron shapes: dense_gpt's with a router and SwiGLU routed experts for the MLP."""
    dense = {k: v for k, v in dense_gpt(layers, hidden).items() if not k.startswith(("decoder.layers.mlp.linear_fc1.w", "decoder.layers.mlp.linear_fc2"))}
    experts_at = "decoder.layers.mlp.experts.experts."
    return {**dense, "decoder.layers.mlp.router.weight": (layers, experts, hidden),
            f"{experts_at}linear_fc1.weight": (layers, experts, 2 * 8, hidden), f"{experts_at}linear_fc2.weight": (layers, experts, hidden, 8)}  # fmt: skip


def saved_moe_buckets(shapes: dict, ep: int, module: str = "SequentialMLP") -> dict[str, tuple[int, ...]]:
    """The param buckets megatron-core saves at tp 1, pp 1 and `ep` > 1 (one bucket a buffer): the
    dense one (chained_0) and each expert-parallel rank's experts' (chained_1)."""
    from dtgpt.checkpoint.megatron.bucket_blocks import KeyBlock
    from dtgpt.checkpoint.megatron.expert_buckets import expert_entries, rank_split

    def length(order) -> int:
        position = 0
        for _, shape in reversed(order):
            position = -(-position // PARAM_ALIGNMENT) * PARAM_ALIGNMENT + math.prod(shape)
        return position

    experts = shapes["decoder.layers.mlp.router.weight"][1]
    stored = {f"chained_0.{BUCKET.format(0, 0, 0)}.param": (length(stage_order(shapes, list(shapes), LAYER_SPECS["local"], 0, Parallel())),)}
    for rank in range(ep):
        split = rank_split(rank, ep, experts, module)[1]
        order = [entry for layer in range(shapes["decoder.layers.mlp.router.weight"][0]) for entry in expert_entries(shapes, list(shapes), KeyBlock("decoder.layers.", layer), split)]
        stored[f"chained_1.{BUCKET.format(rank, 0, 0)}.param"] = (length(order),)
    return stored


@pytest.mark.parametrize("experts,ep", [(4, 2), (64, 8)])
def test_each_expert_parallel_rank_holds_its_experts_and_the_check_reads_as_much_whatever_e_and_ep(reads, experts, ep):
    """At ep > 1 expert e's state is in the experts' buffer (chained_1) of expert-parallel rank
    e // (E / ep), whole; the master-weight check adds the first row of the first and the last
    expert's two tensors in the checked layer: 4 rows more, whatever the expert count and ep."""
    shapes = moe_gpt(4, experts)
    layout, spec = bucket_layout(None, {**shapes, **saved_moe_buckets(shapes, ep)}, {}, list(shapes), Parallel(1, (), ep))
    assert layout is not None and spec == "local" and layout.experts == "SequentialMLP"
    fc1 = layout.pieces[("decoder.layers.mlp.experts.experts.linear_fc1.weight", 3)]
    assert sorted((piece.offsets[0], piece.prefix.split(".")[3]) for piece in fc1) == [(e, f"dp_group_idx_{e // (experts // ep)}") for e in range(experts)]
    assert all(piece.shape == (1, 16, 16) for piece in fc1)
    model = [n for key, _, n in reads if not key.endswith(".param")]
    # the final norm and layer 0's 3 1-D tensors; the first rows of experts 0 and E - 1's fc1 (h) and fc2 (ffn 8)
    assert sorted(model) == sorted([16] * 4 + [16, 8] * 2)

