"""Sliding-window attention, attention sinks (softmax_type), the clamped, offset SwiGLU and Llama 4's
qk L2 norm and NoPE blocks (no_rope_freq) against
megatron-core's GPTModel (local layer spec), on CPU in the test process (the patches of
tests/megatron_moe.py): the same weights (every name mapped by Megatron's key map, the learnable
sink's included) and tokens give the same logits, loss and gradient of every parameter.

One more patch: megatron-core builds its sliding-window mask with device="cuda"
(transformer.utils.get_sliding_window_causal_mask); its module sees a torch whose `ones` drops
that device, nothing else changed. Megatron's local path masks with -10000 instead of -inf and
replaces the causal mask by the band [i - left, i]: the same probabilities in fp32.
Plus: the routed experts' clamped SwiGLU against megatron-core's MoELayer; the windowed varlen
path (CUDA) on a CPU stand-in of flash's kernel; the window and NoPE patterns; the config rules,
one line each; Megatron-LM's args compared and taken; the Megatron checkpoint round trip of the
sinks (slow); --apply-residual-connection-post-layernorm, which megatron-core does not read.
"""

import pytest
import torch
import torch.nn.functional as F

from dtgpt.config import Config, ConfigError, ModelConfig, load_config, validate
from dtgpt.model import GPT
from tests.megatron_moe import megatron_session
from tests.test_mtp import BATCH, FFN, HEADS, HIDDEN, SEQ, VOCAB, take_megatron_weights

LAYERS, WINDOW = 4, 3
CASES = {
    # gpt-oss's attention: a 3-token window in blocks 1 and 3 (from 1), full in 2 and 4, learned sinks
    "window_learnable_sink": dict(window_size=(WINDOW, 0), window_attn_skip_freq=2, softmax_type="learnable"),
    "window_pattern_off_by_one": dict(window_size=(WINDOW, 0), window_attn_skip_freq=[0, 1, 1, 0], softmax_type="off-by-one"),
    "clamped_swiglu": dict(glu_linear_offset=1.0, activation_func_clamp_value=0.5),
    # Llama 4's: weightless RMS norms of each query and key head, RoPE skipped in blocks 2 and 4
    "qk_l2_norm_nope": dict(qk_l2_norm=True, no_rope_freq=2),
}  # fmt: skip


class _CpuTorch:
    """torch as megatron-core's transformer.utils sees it: `ones` on the CPU whatever device it names."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def ones(*size, device=None, **kwargs):
        return torch.ones(*size, **kwargs)


@pytest.fixture
def megatron(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import utils

    monkeypatch.setattr(utils, "torch", _CpuTorch())
    yield from megatron_session(monkeypatch)


def megatron_gpt(case: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_activation_fusion=False, persist_layer_norm=False,
        **case,
    )  # fmt: skip
    torch.manual_seed(7)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_l2_norm=case.get("qk_l2_norm", False))
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)  # fmt: skip
    with torch.no_grad():  # norms away from one, weights large enough that a mix-up shows, sinks near the scores
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 1.0 if "softmax_offset" in name else 0.2)
    return model


def dtgpt_cfg(case: dict) -> ModelConfig:
    variants = {**case, "window_size": list(case["window_size"])} if "window_size" in case else case
    if isinstance(variants.get("window_attn_skip_freq"), list):
        variants["window_attn_skip_freq"] = str(variants["window_attn_skip_freq"])
    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                       normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                       untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, **variants)  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_variant_matches_megatron(megatron, case):
    theirs, ours = megatron_gpt(CASES[case]), GPT(dtgpt_cfg(CASES[case]), VOCAB)
    params, mapped = take_megatron_weights(ours, theirs)
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)

    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    logits_theirs = theirs(tokens, positions, causal)  # (B, T, V)
    loss_theirs = F.cross_entropy(logits_theirs.flatten(0, 1), labels.flatten())
    loss_theirs.backward()
    logits_ours = ours(tokens)
    loss_ours = F.cross_entropy(logits_ours.flatten(0, 1), labels.flatten())
    loss_ours.backward()

    torch.testing.assert_close(logits_ours, logits_theirs.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_ours, loss_theirs.detach(), rtol=1e-6, atol=1e-6)
    for name, p in ours.named_parameters():
        key, rows = mapped[name]
        torch.testing.assert_close(p.grad, params[key].grad[rows], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("with_documents", [True, False])
def test_windowed_varlen_kernel_equals_the_masked_path(monkeypatch, with_documents):
    """The CUDA path, on a CPU stand-in of flash's varlen kernel (tests/test_attention_varlen.py):
    a window goes to the kernel as window_size (documents or not: whole rows are one document
    each), with the masked path's output and gradients; a kernel that takes no window (torch's
    varlen_attn without window_size) leaves the masked path to run."""
    from dtgpt import varlen_kernel
    from dtgpt.attention_varlen import Documents
    from dtgpt.data.batch import TokenOptions, build_batch
    from dtgpt.model import CoreAttention
    from tests.test_attention_varlen import EOD, masked_and_varlen, packed_samples, qkv, reference_kernel

    windows = []

    def kernel(*args, window=None, **kwargs):
        windows.append(window)
        return reference_kernel(*args, window=window, **kwargs)

    kernel.takes_window = True
    monkeypatch.setattr(varlen_kernel, "kernel_for", lambda q: kernel)
    core = CoreAttention(dtgpt_cfg(dict(window_size=(WINDOW, 0))), 0).eval()
    batch = build_batch(packed_samples(), TokenOptions(EOD, reset_attention_mask=with_documents))
    documents = batch.model_inputs()["document_ids"] if with_documents else Documents(None, None)

    def run(q, k, v, document_ids):  # the plain ids: the masked path; Documents: the kernel
        if not with_documents and isinstance(document_ids, Documents):
            return core(q, k, v)  # the kernel on the core's whole rows
        if not with_documents:  # the masked path: a kernel without window_size is not taken
            monkeypatch.setattr(kernel, "takes_window", False)
            try:
                return core(q, k, v)
            finally:
                monkeypatch.setattr(kernel, "takes_window", True)
        return core(q, k, v, document_ids=document_ids)

    (masked, masked_grads), (varlen, varlen_grads) = masked_and_varlen(run, qkv(nh=4, ng=2), documents)
    assert windows == [WINDOW], windows  # the masked run called no kernel; the varlen run one, with the window
    torch.testing.assert_close(varlen, masked, rtol=1e-5, atol=1e-6)
    for a, b in zip(varlen_grads, masked_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_window_pattern_is_megatrons():
    """window_attn_skip_freq N: blocks 1.. (from 1) windowed unless a multiple of N; a list: 1 = windowed."""
    every_other = dtgpt_cfg(dict(window_size=(WINDOW, 0), window_attn_skip_freq=2))
    assert [every_other.attention_window(i) for i in range(LAYERS)] == [WINDOW, None, WINDOW, None]
    listed = dtgpt_cfg(dict(window_size=(WINDOW, 0), window_attn_skip_freq=[0, 1, 1, 0]))
    assert [listed.attention_window(i) for i in range(LAYERS)] == [None, WINDOW, WINDOW, None]
    nope = dtgpt_cfg(dict(no_rope_freq=2))  # Megatron's [0]*(N-1)+[1], repeated: 1 = no RoPE
    assert [nope.skips_rope(i) for i in range(LAYERS)] == [False, True, False, True]
    unbounded = dtgpt_cfg(dict(window_size=(-1, 0)))
    assert [unbounded.attention_window(i) for i in range(LAYERS)] == [None] * LAYERS


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window-size=4,2"], "model.window_size=[4, 2]: right must be 0 (GPT attention is causal"),
        (["--window-size=4"], "model.window_size=[4] must be two numbers [left, right]"),
        (["--window-attn-skip-freq=2"], "model.window_attn_skip_freq=2 needs model.window_size"),
        (["--window-size=4,0", "--window-attn-skip-freq=[1,0]"], "model.window_attn_skip_freq='[1,0]' lists 2 blocks, but model.num_layers=4"),
        (["--softmax-type=sinkhorn"], "model.softmax_type='sinkhorn' is not one of: 'vanilla', 'off-by-one', 'learnable'"),
        (["--softmax-type=off-by-one", "--model.multi_latent_attention=true", "--model.position_embedding_type=rope"],
         "model.softmax_type='off-by-one' is not built with model.multi_latent_attention=true"),
        (["--window-size=4,0", "--model.attention_dropout=0.1", "--model.dropout_rng=layout_invariant"],
         "model.window_size=[4, 0] with model.dropout_rng='layout_invariant'"),
        (["--window-size=4,0", "--model.mtp_num_layers=1"], "model.window_size=[4, 0] with model.mtp_num_layers=1"),
        (["--glu-linear-offset=1.0"], "model.glu_linear_offset=1.0 needs model.swiglu=true"),
        (["--swiglu", "--activation-func-clamp-value=0"], "model.activation_func_clamp_value=0.0 must be > 0"),
        (["--qk-l2-norm", "--qk-layernorm"], "model.qk_l2_norm=true and model.qk_layernorm=true: choose one"),
        (["--no-rope-freq=3", "--model.position_embedding_type=rope"], "model.no_rope_freq=3 must be >= 1 and divide model.num_layers=4"),
        (["--no-rope-freq=2"], "model.no_rope_freq=2 needs model.position_embedding_type='rope'"),
    ],
)  # fmt: skip
def test_a_variant_not_built_is_one_line(args, message):
    base = ["--data.mock_data=true", "--model.num_layers=4", "--model.seq_length=32"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, *args])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow
def test_sinks_go_out_to_megatron_and_come_back_with_the_same_logits(tmp_path):
    """A dtgpt checkpoint of gpt-oss's attention (learned sinks drawn wide, windows, the clamped
    SwiGLU) converted to Megatron's torch_dist and to its per-rank files at tp 2: the sinks are
    core_attention.softmax_offset, stacked by layer in torch_dist and split by head over the tp
    ranks' files, and Megatron's checkpoint loads back into the same model (same logits)."""
    import dtgpt
    from dtgpt.checkpoint.megatron import find, load_megatron_model
    from dtgpt.checkpoint.megatron.reader import MegatronReader
    from tests.test_checkpoint_convert import load_script

    model = {**dtgpt_cfg(CASES["window_learnable_sink"]).__dict__, **CASES["clamped_swiglu"], "window_size": [WINDOW, 0],
             "window_attn_skip_freq": 2, "make_vocab_size_divisible_by": VOCAB // 2}  # fmt: skip
    cfg = dtgpt.make_config(model=model, data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB),
                            training=dict(micro_batch_size=2, global_batch_size=2))  # fmt: skip
    runtime = dtgpt.init_distributed(cfg)
    try:
        built = dtgpt.build_model(cfg, runtime, VOCAB)
        sinks = {name: p for name, p in built.parts[0].named_parameters() if name.endswith("softmax_offset")}
        with torch.no_grad():
            for p in sinks.values():
                p.copy_(torch.linspace(-2.0, 3.0, HEADS))
        ckpt = dtgpt.save_checkpoint(tmp_path / "dtgpt", cfg, runtime, built, iteration=1)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ours = built.parts[0].eval()(tokens)
    finally:
        dtgpt.shutdown()
    script = load_script()
    assert script.main(["to-megatron", str(ckpt.parent), str(tmp_path / "torch_dist")]) == 0
    assert script.main(["to-megatron", str(ckpt.parent), str(tmp_path / "per_rank"), "--format", "per-rank", "--tp", "2"]) == 0
    stored = MegatronReader(find(tmp_path / "torch_dist")).common["args"]
    assert (stored.softmax_type, tuple(stored.window_size), stored.window_attn_skip_freq) == ("learnable", (WINDOW, 0), 2)
    for fmt in ("torch_dist", "per_rank"):
        with torch.no_grad():
            theirs = load_megatron_model(find(tmp_path / fmt), cfg.model, VOCAB).eval()
            torch.testing.assert_close(theirs(tokens), ours, rtol=1e-6, atol=1e-6, msg=fmt)
        assert torch.equal(theirs.layers["1"].attention.sink.softmax_offset, torch.linspace(-2.0, 3.0, HEADS))
    first_rank = torch.load(next(find(tmp_path / "per_rank").glob("mp_rank_00*/model_optim_rng.pt")), weights_only=False)["model"]
    assert torch.equal(first_rank["decoder.layers.0.self_attention.core_attention.softmax_offset"], torch.linspace(-2.0, 3.0, HEADS)[:2])


def test_post_layernorm_residual_is_a_flag_megatron_core_does_not_read(megatron):
    """--apply-residual-connection-post-layernorm is accepted with a note: megatron-core's GPTModel
    gives the same logits with it as without (only the legacy model read it), as dtgpt does."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    positions, causal = torch.arange(SEQ).expand(BATCH, SEQ), torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        plain, flagged = (megatron_gpt(dict(apply_residual_connection_post_layernorm=on))(tokens, positions, causal) for on in (False, True))
    assert torch.equal(plain, flagged)
    base = ["--data.mock_data=true"]
    assert load_config(None, [*base, "--apply-residual-connection-post-layernorm"]).model == load_config(None, base).model


@pytest.mark.cuda
def test_the_cuda_kernel_takes_the_window_as_the_masked_path_does():
    """On a GPU whose torch's varlen_attn takes window_size: the windowed core through flash's
    kernel (with documents, bf16) as close to the fp32 masked path as bf16 through the masked path is."""
    from dtgpt import varlen_kernel
    from dtgpt.data.batch import TokenOptions, build_batch
    from dtgpt.model import CoreAttention
    from tests.test_attention_varlen import EOD, close_to_fp32, masked_and_varlen, on_cuda, packed_samples, qkv

    batch = build_batch(packed_samples(B=2, T=256), TokenOptions(EOD, reset_attention_mask=True))
    documents = batch.map(lambda t: t.cuda()).model_inputs()["document_ids"]
    inputs = qkv(B=2, nh=4, ng=2, T=256)
    if varlen_kernel.windowed_kernel_for(on_cuda(inputs, torch.bfloat16)[0], 64) is None:
        pytest.skip("this torch's varlen_attn takes no window_size: the masked path runs")
    core = CoreAttention(dtgpt_cfg(dict(window_size=(64, 0))), 0).eval().cuda()
    (masked, masked_grads), (varlen, varlen_grads) = masked_and_varlen(core, on_cuda(inputs, torch.bfloat16), documents)
    (fp32, fp32_grads), _ = masked_and_varlen(core, on_cuda(inputs, torch.float32), documents)
    close_to_fp32(varlen, masked, fp32, "output")
    for name, a, b, c in zip("qkv", varlen_grads, masked_grads, fp32_grads):
        close_to_fp32(a, b, c, f"grad {name}")


def test_the_variants_are_compared_with_megatrons_args_and_taken_from_them():
    """Megatron-LM's args of gpt-oss's attention against a plain [model]: one line naming the key;
    use_checkpoint_args takes every variant (the patterns as [model]'s list text); args from
    before the flags read as Megatron's defaults."""
    import argparse

    from dtgpt.checkpoint.architecture import VARIANTS, difference, megatron_architecture, megatron_args, with_megatron_architecture

    oss = dtgpt_cfg({**CASES["window_learnable_sink"], **CASES["clamped_swiglu"], "no_rope_freq": 2})
    plain = dtgpt_cfg({})
    args = argparse.Namespace(**megatron_args(oss))
    assert args.window_size == (WINDOW, 0) and args.window_attn_skip_freq == 2
    assert difference(megatron_architecture(args), oss) is None
    assert difference(megatron_architecture(args), plain).startswith(f"model.window_size: the checkpoint has [{WINDOW}, 0] but the config has")
    taken = with_megatron_architecture(args, plain)
    assert difference(megatron_architecture(args), taken) is None
    assert [taken.attention_window(i) for i in range(LAYERS)] == [WINDOW, None, WINDOW, None]
    assert (taken.softmax_type, taken.glu_linear_offset, taken.activation_func_clamp_value) == ("learnable", 1.0, 0.5)
    older = argparse.Namespace(**{k: v for k, v in megatron_args(plain).items() if k not in VARIANTS})
    assert difference(megatron_architecture(older), plain) is None


def test_clamped_swiglu_experts_match_megatron(megatron):
    """The routed experts' SwiGLU with gpt-oss's offset and a clamp that bites (the experts' fc1
    outputs at Megatron's init are about 0.1): megatron-core's MoELayer (tests/test_moe.py's
    comparison: output, router, input and expert gradients)."""
    from tests.megatron_moe import build_layer
    from tests.test_moe import AUX, same_layer_as_megatron

    glu = dict(glu_linear_offset=1.0, activation_func_clamp_value=0.05)
    theirs = build_layer(num_moe_experts=4, moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu, **AUX, **glu)
    same_layer_as_megatron(theirs, {**AUX, **glu, "swiglu": True})


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_hugging_face_formats_refuse_what_they_cannot_hold(layout):
    """GPT-2's and Llama's formats have no window, sink, clamp or NoPE: an export names the key."""
    from dtgpt.checkpoint.gpt2 import gpt2_problems
    from dtgpt.checkpoint.hf_llama import llama_problems

    problems = {"gpt2": gpt2_problems, "llama": llama_problems}[layout]
    assert not any("softmax_type" in p or "window_size" in p for p in problems(dtgpt_cfg({})))
    said = " ".join(problems(dtgpt_cfg({**CASES["window_learnable_sink"], **CASES["qk_l2_norm_nope"]})))
    assert all(f"model.{key}" in said for key in ("window_size", "softmax_type", "qk_l2_norm", "no_rope_freq")), said
