"""Activation memory measured against Megatron's formula (dtgpt/plan/activations.py, Korthikanti et al.).

What a layer keeps for backward is measured as the bytes of the tensors autograd saves during
one forward (torch.autograd.graph.saved_tensors_hooks), each storage counted once, parameters
left out, between the embedding and the final norm, divided by the layers. On CPU this is the
honest measure: torch's CPU allocator keeps no running statistics (nothing like
torch.cuda.max_memory_allocated), and the allocations the profiler records also hold the
transient buffers of each op and FSDP's gathered weights. On a GPU the allocator would add its
rounding to the same tensors.

The tiny config is bf16 (Megatron's regime: the model computes in bf16 over fp32 masters),
hidden dropout 0.1 and attention dropout 0, and scaled_dot_product_attention runs its flash
kernel (by name; the CPU's has no dropout, and takes it by itself without one), which keeps q, k,
v, the output and a log-sum-exp, no a·s×s scores: the formula is stated for that kernel
(scores_kept=False, as Megatron with flash attention). The scores term is
measured on the math kernel, in fp32: on CPU the math kernel computes bf16 inputs in fp32, so
only in fp32 does it keep the softmax output in the dtype the formula counts. Attention dropout
is 0 in both: the math kernel keeps its mask in the input's dtype, not as Korthikanti's 1 byte.
Tensor parallelism with sequence parallelism is built at tp 2 on PyTorch's fake process group
(one process, as the planner builds ranks: the collectives move nothing, the shapes are real).

    PYTHONPATH=. python tests/test_activation_memory.py    # prints the table in docs/plan.md
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtgpt
from dtgpt.config import Config, padded_vocabulary
from dtgpt.model import GPT
from dtgpt.parallel import ParallelDims, build_model_parts
from dtgpt.plan.activations import ActivationShape, layer_activation_bytes
from dtgpt.plan.activations_mtp import mtp_activation_bytes, mtp_activation_terms

VOCAB = 32
LAYERS = 2
MODEL = dict(num_layers=LAYERS, hidden_size=256, num_attention_heads=4, seq_length=64, hidden_dropout=0.1, attention_dropout=0.0)
# The Llama-style family with LayerNorm: on CPU torch's RMSNorm is a composite that keeps fp32
# copies of its input and output (CUDA's fused kernel keeps the input and the statistics, as
# LayerNorm's fused kernel does on both).
FAMILY = dict(swiglu=True, add_bias_linear=False, group_query_attention=True, num_query_groups=2, qk_layernorm=True,
              position_embedding_type="rope")  # fmt: skip
MOE_KEYS = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_grouped_gemm=True)
MOE = dict(FAMILY, qk_layernorm=False, **MOE_KEYS)
# DeepSeek-V3's attention: a compressed query, norms on the compressed vectors, q/k wider than v
# (so no CPU flash kernel: the math kernel, in fp32 as the scores case); a narrow MLP, so that
# the attention's terms decide the sum (modelled as grouped-query attention it is 40-65 % off)
MLA = dict(FAMILY, group_query_attention=False, num_query_groups=1, multi_latent_attention=True, q_lora_rank=192,
           kv_lora_rank=128, qk_head_dim=96, qk_pos_emb_head_dim=32, v_head_dim=64, rope_type="rope", ffn_hidden_size=64)
RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full, groups of 1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full, one group of 2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    **{"selective " + "+".join(m): dict(recompute_granularity="selective", recompute_modules=m) for m in (
        ["mlp"], ["layernorm"], ["mlp", "layernorm"], ["moe"], ["moe", "layernorm"], ["moe_act"], ["mla_up_proj"],
        ["core_attn", "mla_up_proj", "layernorm"], ["mlp", "moe", "mla_up_proj", "layernorm"])},  # the last: DeepSeek-V3's
}
CASES = {
    # name: (recompute, tp, precision, model overrides, the attention kernel keeps the scores)
    "bf16, flash": (["none", "selective", "full, groups of 1", "full, one group of 2", "selective mlp",
                     "selective layernorm", "selective mlp+layernorm"], 1, "bf16", {}, False),
    "bf16, tp2 + SP, flash": (["none", "selective", "full, groups of 1", "selective mlp+layernorm"], 2, "bf16", {}, False),
    "fp32, math kernel": (["none", "selective"], 1, "fp32", dict(seq_length=128, hidden_size=128), True),
    # 2 key/value groups for 4 heads, SwiGLU, qk-layernorm, RoPE, no biases
    "bf16 GQA+SwiGLU, tp2+SP": (["none", "selective"], 2, "bf16", FAMILY, False),
    # Mixtral's MoE block: 4 SwiGLU experts, top-2, the load-balancing loss, in every block
    "bf16 MoE top-2, flash": (["none", "full, groups of 1", "selective moe", "selective moe+layernorm", "selective moe_act"],
                              1, "bf16", MOE, False),
    # with a shared expert and its gate (Qwen2-MoE's)
    "bf16 MoE, gated shared expert": (["none"], 1, "bf16", dict(MOE, moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True), False),
    "fp32 MLA, math kernel": (["none", "selective", "selective mla_up_proj", "selective core_attn+mla_up_proj+layernorm"],
                              1, "fp32", MLA, True),
    "fp32 MLA, tp2+SP, math": (["none", "selective"], 2, "fp32", MLA, True),
    # DeepSeek-V3's attention with MoE blocks, and its launch script's recompute_modules
    "fp32 MLA+MoE, math": (["none", "selective mlp+moe+mla_up_proj+layernorm"], 1, "fp32", {**MLA, **MOE_KEYS}, True),
}
TOLERANCE = 0.05

pytestmark = pytest.mark.slow  # about 30 s: `make test` runs it, the edit loop (make test-fast) does not


def _config(recompute: str, tp: int, precision: str, model: dict) -> Config:
    return dtgpt.make_config(
        model={**MODEL, **model},
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB, num_workers=0),
        training=dict(micro_batch_size=2, global_batch_size=2, train_iters=1, bf16=precision == "bf16", **RECOMPUTE[recompute]),
        parallel=dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1),
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def saved_bytes_by_part(cfg: Config, tp: int, kernel: SDPBackend) -> dict[str, float]:
    """Bytes tp rank 0 saves for backward in one training forward with `kernel`, by the part
    that saved each storage first: "blocks" (from the embedding's output to the final norm),
    "head", "mtp" (the prediction modules: what the head already keeps is not theirs)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        dims = ParallelDims.from_config(cfg, tp)
        dims.build_mesh("cpu")
        with torch.device("meta"):
            whole = GPT(cfg.model, padded_vocabulary(cfg, VOCAB))
        model = build_model_parts(cfg, dims, whole, torch.device("cpu")).forward_module()  # the bf16 compute copy (dp x cp = 1)
        params, saved, part = set(), [], ["embedding"]

        def note_params(module, args):  # the compute copy's (or FSDP's gathered) parameters are in place by now
            params.update(_local(p).untyped_storage().data_ptr() for p in module.parameters(recurse=False))

        def enter(name: str, after: str | None = None):
            return lambda *_: part.__setitem__(0, name) if after is None or part[0] == after else None

        for module in model.modules():
            module.register_forward_pre_hook(note_params)
        model.embedding.register_forward_hook(enter("blocks", after="embedding"))  # the prediction modules embed too
        model.norm.register_forward_pre_hook(enter("head"))
        if model.mtp is not None:
            model.mtp.register_forward_pre_hook(enter("mtp"))

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in params:
                saved.append((part[0], storage))
            return t

        tokens = torch.randint(0, VOCAB, (cfg.training.micro_batch_size, cfg.model.seq_length))
        model.train()
        with sdpa_kernel(kernel), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens)
        # Counted once the forward is done: recomputation may have released a saved storage (its
        # size is 0 then, until backward refills it: dtgpt.discard); live storages are distinct.
        seen = {}
        for where, storage in saved:
            if storage.nbytes():
                seen.setdefault(storage.data_ptr(), (where, storage.nbytes()))
        return {name: sum(n for where, n in seen.values() if where == name) for name in ("blocks", "head", "mtp")}
    finally:
        dist.destroy_process_group()


def saved_bytes_per_layer(cfg: Config, tp: int, kernel: SDPBackend) -> float:
    """Bytes the blocks of tp rank 0 save for backward in one training forward with `kernel`, per block."""
    return saved_bytes_by_part(cfg, tp, kernel)["blocks"] / cfg.model.num_layers


def formula(cfg: Config, tp: int, scores_kept: bool, *, megatron_sp: bool = False) -> ActivationShape:
    shape = ActivationShape.for_config(cfg, padded_vocabulary(cfg, VOCAB), tp, scores_kept=scores_kept)
    return dataclasses.replace(shape, megatron_sp=megatron_sp)


def _expected(cfg: Config, recompute: str, tp: int, scores_kept: bool, megatron_sp: bool = False) -> float:
    """The formula for one layer: full recomputation keeps one input per group, over its layers."""
    shape = formula(cfg, tp, scores_kept, megatron_sp=megatron_sp)
    if recompute.startswith("full"):
        groups = -(-LAYERS // cfg.training.recompute_num_layers)
        return groups * layer_activation_bytes(shape, "full") / LAYERS
    return layer_activation_bytes(shape, recompute.split()[0], moe=cfg.model.moe_enabled)  # "selective mlp": its modules are the config's


def _measure(case: str, recompute: str) -> tuple[float, float, float, Config]:
    settings, tp, precision, model, scores_kept = CASES[case]
    cfg = _config(recompute, tp, precision, model)
    kernel = SDPBackend.MATH if scores_kept else SDPBackend.FLASH_ATTENTION
    measured = saved_bytes_per_layer(cfg, tp, kernel)
    return measured, _expected(cfg, recompute, tp, scores_kept), _expected(cfg, recompute, tp, scores_kept, True), cfg


@pytest.mark.parametrize("case,recompute", [(c, r) for c, (rs, *_) in CASES.items() for r in rs])
def test_saved_activations_match_the_formula(case, recompute):
    measured, expected, _, _ = _measure(case, recompute)
    assert measured == pytest.approx(expected, rel=TOLERANCE), (case, recompute)


# Two prediction modules (the second reads the first's output) after the model of a case
MTP_CASES = {
    # name: (case, recompute)
    "bf16, flash": ("bf16, flash", "none"),
    "bf16, flash, selective": ("bf16, flash", "selective"),
    "bf16, tp2 + SP, flash": ("bf16, tp2 + SP, flash", "none"),
    "bf16 MoE top-2, flash": ("bf16 MoE top-2, flash", "none"),
    "fp32 MLA, math kernel": ("fp32 MLA, math kernel", "none"),
}
MTP_DEPTH = 2


@pytest.mark.parametrize("name", list(MTP_CASES))
def test_prediction_modules_keep_what_the_formula_counts(name):
    """The saved tensors of the prediction modules' forward: each depth's mtp_activation_terms
    but the logits, which the loss keeps (head_activation_terms' share for the main head too)."""
    case, recompute = MTP_CASES[name]
    _, tp, precision, model, scores_kept = CASES[case]
    cfg = _config(recompute, tp, precision, {**model, "mtp_num_layers": MTP_DEPTH})
    measured = saved_bytes_by_part(cfg, tp, SDPBackend.MATH if scores_kept else SDPBackend.FLASH_ATTENTION)["mtp"]
    terms = mtp_activation_terms(formula(cfg, tp, scores_kept), recompute, moe=cfg.model.moe_enabled)
    assert measured == pytest.approx(MTP_DEPTH * (sum(terms.values()) - terms["logits"]), rel=TOLERANCE), name


def test_the_plan_counts_the_prediction_modules_on_the_last_stage():
    """pp 2: the last stage's activations grow by its micro-batches in flight times the modules'
    bytes, logits included; the first stage's do not change."""
    from dtgpt.plan import plan_layout
    from dtgpt.plan import memory as pm

    def plan(mtp: int | None):
        cfg = _config("none", 1, "bf16", dict(num_layers=4, position_embedding_type="rope", mtp_num_layers=mtp))
        cfg.parallel.pipeline_model_parallel_size = 2
        cfg.training.global_batch_size = 8
        return cfg, {r.pp_rank: r for r in plan_layout(cfg, 2).ranks}

    cfg, with_mtp = plan(MTP_DEPTH)
    _, without = plan(None)
    shape = ActivationShape.for_config(cfg, padded_vocabulary(cfg, VOCAB), 1)
    grown = (with_mtp[1].memory["activations"] - without[1].memory["activations"]) * pm.GIB
    assert grown == pytest.approx(with_mtp[1].in_flight * mtp_activation_bytes(shape, MTP_DEPTH), rel=1e-9)
    assert with_mtp[0].memory["activations"] == without[0].memory["activations"]


def main() -> None:
    print("bytes one layer keeps on tp rank 0, in units of s·b·h; the formula for dtgpt, and with Megatron's SP")
    print(f"{'case':<24} {'recompute':<22} {'measured':>9} {'formula':>9} {'Megatron':>9} {'ratio':>6}")
    for case, (settings, *_) in CASES.items():
        for recompute in settings:
            measured, expected, megatron, cfg = _measure(case, recompute)
            sbh = cfg.model.seq_length * cfg.training.micro_batch_size * cfg.model.hidden_size
            print(f"{case:<24} {recompute:<22} {measured / sbh:>9.3f} {expected / sbh:>9.3f} {megatron / sbh:>9.3f} "
                  f"{measured / expected:>6.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
