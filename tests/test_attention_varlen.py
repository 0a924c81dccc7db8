"""Document masking through flash attention's varlen kernel (dtgpt/attention_varlen.py).

The kernel is CUDA only, so on CPU these test its plumbing: the bounds the loader counts, and the
attention built on them with a CPU reference standing in for the kernel (per packed segment, SDPA
with causal masking aligned bottom-right, as flash aligns it), against the masked path: output
and gradients, plain, grouped-query, MLA's value head dim and the context-parallel chunks. The
last test runs the real kernel where CUDA is (scripts/gpu_check.sh runs it).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dtgpt import varlen_kernel
from dtgpt.attention_varlen import DocumentBounds, Documents
from dtgpt.config import load_config
from dtgpt.data.batch import TokenOptions, build_batch, document_ids
from dtgpt.model import CoreAttention
from dtgpt.parallel.context import split_sequence
from tests.test_context import GatheredByHand

EOD = 0


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):
    """What the varlen kernel computes, segment by segment (checks the host integers too); a
    window: each query sees the keys at most `window` before it (flash's window_size=(window, 0))."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    assert cu_q[0] == cu_k[0] == 0 and cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
    assert max_q == max(np.diff(cu_q)) and max_k == max(np.diff(cu_k))
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0  # what flash takes
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x, (a, b) in ((q, cu_q[i : i + 2]), (k, cu_k[i : i + 2]), (v, cu_k[i : i + 2])))
        nq, nk = qs.shape[1], ks.shape[1]
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)  # bottom-right
        if window is not None:
            allowed &= torch.arange(nk)[None, :] >= torch.arange(nq)[:, None] + (nk - nq) - window
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture
def stand_in(monkeypatch) -> list[int]:
    """The reference stands in for the kernel on every device; yields the query rows of each call."""
    calls = []

    def kernel(q, *args, **kwargs):
        calls.append(q.shape[0])
        return reference_kernel(q, *args, **kwargs)

    monkeypatch.setattr(varlen_kernel, "kernel_for", lambda q: kernel)
    return calls


def packed_samples(B: int = 3, T: int = 24, seed: int = 0) -> torch.Tensor:
    """(B, T + 1) token ids with eods at random places; row 0 has none (one document that came
    from the previous sample and crosses into the next), the last row ends with an eod."""
    g = torch.Generator().manual_seed(seed)
    samples = torch.randint(1, 50, (B, T + 1), generator=g)
    for row in range(1, B):
        samples[row, torch.randint(0, T, (3,), generator=g)] = EOD
    samples[-1, T - 1] = EOD
    return samples


def expected_cu(documents: torch.Tensor) -> list[int]:
    """Flat document bounds from the ids, the slow way: a new sequence wherever the id changes
    or a row starts."""
    cu, T = [], documents.shape[1]
    for row, ids in enumerate(documents.tolist()):
        cu += [row * T + t for t in range(T) if t == 0 or ids[t] != ids[t - 1]]
    return cu + [documents.numel()]


def test_the_loader_counts_each_rows_documents_and_each_micro_batchs():
    batch = build_batch(packed_samples(B=4), TokenOptions(EOD, reset_attention_mask=True))
    bounds, documents = batch.document_bounds, batch.document_ids
    assert documents[0].tolist() == [0] * 24  # no eod: one document across the whole row
    cu, longest = bounds.packed()
    assert cu.dtype == torch.int32 and cu.tolist() == expected_cu(documents)
    assert longest == max(np.diff(expected_cu(documents))) == 24
    for n in (2, 4):
        for micro, ids in zip(batch.chunk(n), documents.chunk(n)):
            cu, longest = micro.document_bounds.packed()
            assert cu.tolist() == expected_cu(ids) and longest == max(np.diff(expected_cu(ids)))
            assert micro.model_inputs()["document_ids"].ids is micro.document_ids
    # The bounds follow the tokens' device and are never cut along the sequence (cp chunks).
    cut = batch.map(lambda t: split_sequence(t, 1, 2))
    assert cut.document_bounds is bounds and cut.document_ids.shape == (4, 12)
    plain = build_batch(packed_samples(), TokenOptions(EOD, reset_position_ids=True))
    assert plain.document_bounds is None and "document_ids" not in plain.model_inputs()


def test_every_block_of_a_micro_batch_shares_what_the_bounds_derive():
    """FSDP casts each unit's inputs by rebuilding dataclasses and dicts; the derived bounds (a
    device op, or the host's cp index and copies) must still be made once per micro-batch."""
    from torch.distributed.utils import _apply_to_tensors  # what fully_shard's input cast calls

    batch = build_batch(packed_samples(B=4), TokenOptions(EOD, reset_attention_mask=True))
    micro = batch.chunk(2)[1].model_inputs()["document_ids"]
    cast = _apply_to_tensors(lambda t: t.bfloat16() if t.is_floating_point() else t, micro)
    assert cast.bounds.packed() is micro.bounds.packed()
    assert cast.bounds.context_parallel(0, 2) is micro.bounds.context_parallel(0, 2)


def test_document_ids_follow_an_eod_into_the_next_document():
    ids = document_ids(torch.tensor([[5, EOD, 6, 7, EOD, EOD, 8]]), EOD)
    assert DocumentBounds.of(ids).packed()[0].tolist() == [0, 2, 5, 6, 7]


def qkv(B=3, nh=4, ng=4, T=24, d=8, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, T, nh, d), (B, T, ng, d), (B, T, ng, dv or d))
    # Head-major views of token-major tensors, as attention hands them to its core.
    return [torch.randn(*s, generator=g).transpose(1, 2).requires_grad_() for s in shapes]


def core():
    return CoreAttention(load_config(None, ["--data.mock_data=true"]).model).eval()  # no attention dropout


def masked_and_varlen(run, inputs, documents):
    """(output, gradients) of `run(q, k, v, document_ids)` with the plain ids and with Documents."""
    results = []
    for document_ids in (documents.ids, documents):
        leaves = [x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in inputs]
        out = run(*leaves, document_ids)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), [x.grad for x in leaves]))
    return results


@pytest.mark.parametrize("shape", [dict(), dict(nh=4, ng=2), dict(d=12, dv=8)], ids=["plain", "gqa", "mla"])
def test_varlen_attention_equals_the_masked_path(stand_in, shape):
    batch = build_batch(packed_samples(), TokenOptions(EOD, reset_attention_mask=True))
    documents = batch.model_inputs()["document_ids"]
    (masked, masked_grads), (varlen, varlen_grads) = masked_and_varlen(core(), qkv(**shape), documents)
    torch.testing.assert_close(varlen, masked, rtol=1e-5, atol=1e-6)
    for a, b in zip(varlen_grads, masked_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("with_documents", [True, False])
def test_context_parallel_chunks_through_varlen_equal_the_masked_path(stand_in, cp, with_documents):
    """Each cp rank's chunks (per-document segments against their keys up to the chunk's end)
    give the masked path's output and gradients; without documents, plain causal."""
    T = 32
    samples = packed_samples(B=2, T=T, seed=1)
    samples[1, 2 * T // 4 - 1] = EOD  # a document that starts exactly at a chunk boundary
    batch = build_batch(samples, TokenOptions(EOD, reset_attention_mask=True))
    bounds = batch.document_bounds if with_documents else DocumentBounds.whole_rows(2, T)
    ids = batch.document_ids if with_documents else torch.zeros(2, T, dtype=torch.long)
    inputs = qkv(B=2, nh=4, ng=2, T=T, d=12, dv=8)

    def all_ranks(t, dim):  # what the all-gather returns
        return torch.cat([split_sequence(t, r, cp, dim) for r in range(cp)], dim)

    for r in range(cp):
        def run(q, k, v, document_ids, r=r):
            local = [split_sequence(x, r, cp, dim=2) for x in (q, k, v)]
            docs = Documents(split_sequence(ids, r, cp), bounds) if isinstance(document_ids, Documents) else split_sequence(ids, r, cp)
            gathered = [all_ranks(k, 2), all_ranks(v, 2), all_ranks(ids, 1)]
            if not with_documents and isinstance(document_ids, Documents):
                docs = None  # the cp core's own whole-row bounds
            return GatheredByHand(r, cp, gathered)(*local, document_ids=docs)

        (masked, masked_grads), (varlen, varlen_grads) = masked_and_varlen(run, inputs, Documents(ids, bounds))
        torch.testing.assert_close(varlen, masked, rtol=1e-5, atol=1e-6)
        for a, b in zip(varlen_grads, masked_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _StubMesh:
    def get_local_rank(self):
        return 1

    def size(self):
        return 2


def test_without_documents_every_cp_layer_shares_one_whole_row_index(stand_in, monkeypatch):
    """Plain causal attention under cp runs the varlen kernel on one-document-per-row bounds:
    apply_cp gives every core of a part (the prediction module's too) one WholeRows, so the
    host index of this rank's chunks is built once per micro-batch shape, not once per layer."""
    from dtgpt.model import GPT
    from dtgpt.mtp import named_blocks
    from dtgpt.parallel.context import ContextParallelAttention, WholeRows, apply_cp

    cfg = load_config(None, ["--data.mock_data=true", "--model.num_layers=3", "--model.mtp_num_layers=1"]).model
    model = GPT(cfg, 64)
    apply_cp(model, _StubMesh())
    cores = [block.attention.core for block in named_blocks(model).values()]
    assert len(cores) == 4 and all(isinstance(c, ContextParallelAttention) for c in cores)
    assert len({id(c.whole_rows) for c in cores}) == 1
    built = []
    derive = DocumentBounds._context_parallel
    monkeypatch.setattr(DocumentBounds, "_context_parallel", lambda self, *a: built.append(a) or derive(self, *a))
    whole_rows, T = WholeRows(), 32
    q, k, v = qkv(B=2, T=T)
    for micro_batch in range(2):
        for layer in range(3):
            core = GatheredByHand(1, 2, [k, v])
            core.whole_rows = whole_rows
            core(*(split_sequence(x.detach(), 1, 2, dim=2) for x in (q, k, v)), document_ids=None)
    assert built == [(1, 2)] and len(stand_in) == 6


def test_the_varlen_path_reads_nothing_back_from_the_device(monkeypatch):
    """No host sync (tests/sync_probe.py) in the attention itself, nor in its cp chunks: every
    integer the kernel takes was counted on the host when the batch was built."""
    from tests.sync_probe import SyncProbe

    monkeypatch.setattr(varlen_kernel, "kernel_for", lambda q: lambda q, k, v, *args, scale: q * scale)
    batch = build_batch(packed_samples(B=2, T=32), TokenOptions(EOD, reset_attention_mask=True))
    micro = batch.chunk(2)[1]
    q, k, v = qkv(B=1, T=32)
    with SyncProbe() as probe:
        core()(q, k, v, document_ids=micro.model_inputs()["document_ids"]).sum().backward()
        local = [split_sequence(x.detach(), 1, 2, dim=2) for x in (q, k, v)]
        documents = Documents(split_sequence(micro.document_ids, 1, 2), micro.document_bounds)
        GatheredByHand(1, 2, [k, v])(*local, document_ids=documents)
    assert probe.count == 0, probe.calls


def test_on_cpu_the_default_path_is_the_masked_one():
    """No kernel for CPU tensors (nor fp32 ones): Documents run exactly today's masked SDPA."""
    q, k, v = qkv()
    assert varlen_kernel.kernel_for(q) is None and varlen_kernel.kernel_for(q.bfloat16()) is None
    batch = build_batch(packed_samples(), TokenOptions(EOD, reset_attention_mask=True))
    attention = core()
    assert torch.equal(attention(q, k, v, batch.model_inputs()["document_ids"]), attention(q, k, v, batch.document_ids))


def test_this_torch_has_the_varlen_signature_the_adapter_reads():
    """Fails when torch changes varlen_attn: then dtgpt/varlen_kernel.py needs a look (and
    CHECKED_TORCH a new entry)."""
    assert torch.__version__.startswith(varlen_kernel.CHECKED_TORCH), torch.__version__
    assert varlen_kernel._torch_kernel() is not None


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
    return reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None) if is_causal else None


def _varlen_main(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    return reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale) if window_size == (-1, 0) else None


def _varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    assert enable_gqa == (key.shape[1] != query.shape[1])
    return _varlen_main(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)


@pytest.mark.slow
@pytest.mark.parametrize("varlen", [_varlen_2_10, _varlen_main, _varlen_2_13], ids=["is_causal", "window_size", "enable_gqa"])
def test_the_adapter_speaks_each_form_of_varlen_attn(monkeypatch, varlen):
    """Causal, the softmax scale and grouped-query heads reach each signature torch has had."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen)
    varlen_kernel._torch_kernel.cache_clear()
    try:
        kernel = varlen_kernel._torch_kernel()
        monkeypatch.setattr(varlen_kernel, "kernel_for", lambda q: kernel)
        batch = build_batch(packed_samples(), TokenOptions(EOD, reset_attention_mask=True))
        (masked, _), (through, _) = masked_and_varlen(core(), qkv(nh=4, ng=2, d=12, dv=8), batch.model_inputs()["document_ids"])
        torch.testing.assert_close(through, masked, rtol=1e-5, atol=1e-6)
    finally:
        varlen_kernel._torch_kernel.cache_clear()


MODELS = {
    "gqa": dict(num_query_groups=2, position_embedding_type="rope"),
    "mla_mtp": dict(multi_latent_attention=True, position_embedding_type="rope", kv_lora_rank=12, qk_head_dim=10,
                    qk_pos_emb_head_dim=8, v_head_dim=6, mtp_num_layers=1),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MODELS))
def test_a_training_step_through_varlen_equals_the_masked_one(stand_in, family):
    """The bounds reach every attention core through the step's micro-batches, full
    recomputation and the prediction modules: the same loss and gradients as the masked path."""
    from dtgpt.config import Config, ModelConfig
    from dtgpt.model import GPT
    from dtgpt.parallel import ParallelDims, build_model_parts
    from dtgpt.step import local_forward_backward

    cfg = Config()
    cfg.model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, hidden_dropout=0.0,
                            attention_dropout=0.0, **MODELS[family])  # fmt: skip
    cfg.training.recompute_granularity, cfg.training.recompute_method, cfg.training.recompute_num_layers = "full", "uniform", 1
    options = TokenOptions(EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    batch = build_batch(packed_samples(B=4), options)
    results = []
    for bounds in (None, batch.document_bounds):
        with torch.device("meta"):
            whole = GPT(cfg.model, 64)
        model = build_model_parts(cfg, ParallelDims.from_config(cfg, 1), whole, torch.device("cpu"))
        loss = local_forward_backward(model, replace(batch, document_bounds=bounds), 2)
        # Per micro-batch: each block's core in forward and again in its recomputation, the prediction module's once.
        assert len(stand_in) == (0 if bounds is None else 2 * (2 * 2 + (cfg.model.mtp_num_layers or 0)))
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (masked, masked_grads), (varlen, varlen_grads) = results
    torch.testing.assert_close(varlen, masked, rtol=1e-5, atol=1e-6)
    for name in masked_grads:
        torch.testing.assert_close(varlen_grads[name], masked_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["pp2", "pp2_cp2"])
def test_pipeline_stages_take_the_varlen_path_and_train_as_one_process(stand_in, tmp_path, world):
    """The bounds reach every stage for each micro-batch (the schedule cuts only tensors):
    pp2 (1F1B, interleaved) on 2 gloo ranks, and pp2 x cp2 on 4, train as one process does,
    loss, gradient norm and parameters, and every stage ran each of its micro-batches' attention
    through the kernel (its count would be short if a stage fell back to the mask)."""
    import dtgpt
    from tests import varlen_pp_worker as worker
    from tests.parity_oracle import assert_params_match
    from tests.runs import run_worker

    run_worker("varlen_pp_worker.py", world, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    one = worker.train(worker.config(), dtgpt.init_distributed(worker.config()))
    assert len(stand_in) == worker.ITERATIONS * worker.MICRO_BATCHES * worker.LAYERS
    for layout in worker.LAYOUTS[world]:
        runs = [rank[layout] for rank in ranks]
        for run in runs:  # the loss and norm are the same on every rank
            torch.testing.assert_close(run["losses"], one["losses"], rtol=1e-5, atol=0, msg=layout)
            torch.testing.assert_close(run["grad_norms"], one["grad_norms"], rtol=1e-5, atol=0, msg=layout)
            # Each micro-batch through each of the rank's blocks, and once more at the first step:
            # the schedule's stand-in forward that infers the stages' shapes (micro-batch 0's inputs).
            assert run["calls"] == (worker.ITERATIONS * worker.MICRO_BATCHES + 1) * run["layers_here"], layout
        params = {}
        for run in runs:  # pp ranks hold different blocks; cp ranks the same parameters
            for name, value in run["params"].items():
                assert name not in params or torch.equal(params[name], value), name
                params[name] = value
        # The parity oracle's comparison (the key bias, whose gradient is rounding noise, only within the whole).
        assert_params_match(params, one["params"], heads=4)


def close_to_fp32(bf16: torch.Tensor, reference_bf16: torch.Tensor, fp32: torch.Tensor, name: str) -> None:
    """bf16 through the kernel is as close to the fp32 masked result as bf16 through the masked
    path is (within 2x), or within 1% of the tensor's largest value."""
    error, reference_error = (bf16.float() - fp32).abs().max(), (reference_bf16.float() - fp32).abs().max()
    assert error <= max(2 * reference_error, 1e-2 * fp32.abs().max()), (name, error.item(), reference_error.item())


def on_cuda(inputs, dtype):
    return [x.detach().cuda().to(dtype).transpose(1, 2).contiguous().transpose(1, 2) for x in inputs]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [dict(), dict(nh=4, ng=2), dict(d=12, dv=8)], ids=["plain", "gqa", "mla"])
def test_the_cuda_kernel_matches_the_masked_path_in_bf16(shape):
    batch = build_batch(packed_samples(B=2, T=256), TokenOptions(EOD, reset_attention_mask=True))
    documents = batch.map(lambda t: t.cuda()).model_inputs()["document_ids"]
    inputs = qkv(B=2, T=256, **shape)
    assert varlen_kernel.kernel_for(on_cuda(inputs, torch.bfloat16)[0]) is not None, "flash's varlen kernel should run here"
    (masked, masked_grads), (varlen, varlen_grads) = masked_and_varlen(core().cuda(), on_cuda(inputs, torch.bfloat16), documents)
    (fp32, fp32_grads), _ = masked_and_varlen(core().cuda(), on_cuda(inputs, torch.float32), documents)  # fp32: masked both times
    close_to_fp32(varlen, masked, fp32, "output")
    for name, a, b, c in zip("qkv", varlen_grads, masked_grads, fp32_grads):
        close_to_fp32(a, b, c, f"grad {name}")


@pytest.mark.cuda
def test_the_cuda_kernel_aligns_each_cp_chunk_bottom_right():
    """The cp segments rest on flash's causal alignment (the last query sees the last key): each
    rank's chunks through the kernel match the masked path."""
    T, cp = 256, 2
    batch = build_batch(packed_samples(B=2, T=T, seed=1), TokenOptions(EOD, reset_attention_mask=True)).map(lambda t: t.cuda())
    ids = batch.document_ids
    inputs = qkv(B=2, nh=4, ng=2, T=T)

    def all_ranks(t, dim):
        return torch.cat([split_sequence(t, r, cp, dim) for r in range(cp)], dim)

    for r in range(cp):
        def run(q, k, v, document_ids, r=r):
            local = [split_sequence(x, r, cp, dim=2) for x in (q, k, v)]
            docs = split_sequence(ids, r, cp)
            if isinstance(document_ids, Documents):
                docs = Documents(docs, batch.document_bounds)
            return GatheredByHand(r, cp, [all_ranks(k, 2), all_ranks(v, 2), all_ranks(ids, 1)])(*local, document_ids=docs)

        documents = Documents(ids, batch.document_bounds)
        (masked, masked_grads), (varlen, varlen_grads) = masked_and_varlen(run, on_cuda(inputs, torch.bfloat16), documents)
        (fp32, fp32_grads), _ = masked_and_varlen(run, on_cuda(inputs, torch.float32), documents)
        close_to_fp32(varlen, masked, fp32, f"rank {r} output")
        for name, a, b, c in zip("qkv", varlen_grads, masked_grads, fp32_grads):
            close_to_fp32(a, b, c, f"rank {r} grad {name}")
