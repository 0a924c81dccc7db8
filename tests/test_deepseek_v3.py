"""configs/deepseek_v3.toml: DeepSeek-V3's published architecture, counted and planned.

The dry-run's count (the planner builds every kind of rank on meta and checks the built count
against dtgpt/model_size.py's closed form) is DeepSeek's 671B, ~37B active per token; the FLOPs
per token are Megatron-LM's num_floating_point_operations for multi-latent attention and
dense-first MoE (written out below from its formula: megatron.training is not in the installed
package), for DeepSeek-V3 and for a model without the compressed query."""

import dataclasses

import pytest

from dtgpt.config import load_config
from dtgpt.model_size import flops_per_token, num_parameters
from tests.runs import REPO

CONFIG = str(REPO / "configs" / "deepseek_v3.toml")


def megatron_flops_per_token(m, vocab: int) -> float:
    """Megatron-LM's num_floating_point_operations / (batch x seq) for MLA + MoE (no MTP)."""
    h, nh, s, L = m.hidden_size, m.num_attention_heads, m.seq_length, m.num_layers
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    moe = sum(m.is_moe_layer(i) for i in range(L))
    gated = 1.5 if m.swiglu else 1.0
    q_term = h * nh * qk if m.q_lora_rank is None else m.q_lora_rank * (h + nh * qk + 1)
    self_attn = 6 * L * (
        q_term + m.kv_lora_rank * (h + nh * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
        + nh * m.v_head_dim * h + s * nh * qk / 2 + s * nh * m.v_head_dim / 2
    )  # fmt: skip
    shared = m.moe_shared_expert_intermediate_size or 0
    mlp = 12 * L * h * (
        m.ffn_hidden_size * gated * (L - moe) / L + m.moe_ffn_hidden_size * m.moe_router_topk * gated * moe / L
        + shared * gated * moe / L
    )  # fmt: skip
    return mlp + self_attn + 6 * h * vocab


def test_deepseek_v3_counts_and_flops_are_megatrons():
    m = load_config(CONFIG).model
    assert num_parameters(m, 129280) == pytest.approx(671e9, rel=0.02)
    assert num_parameters(m, 129280, active=True) == pytest.approx(37e9, rel=0.02)
    assert flops_per_token(m, 129280) == pytest.approx(megatron_flops_per_token(m, 129280), rel=1e-12)
    no_compression = dataclasses.replace(m, q_lora_rank=None, qk_layernorm=False)
    assert flops_per_token(no_compression, 129280) == pytest.approx(megatron_flops_per_token(no_compression, 129280), rel=1e-12)


@pytest.mark.slow
def test_dry_run_counts_671b():
    """What `train.py --config configs/deepseek_v3.toml --dry-run` prints, from the ranks it builds."""
    from dtgpt.plan import plan_layout

    plan = plan_layout(load_config(CONFIG))
    assert plan.world_size == 1024 and plan.mesh["ep"] == 64
    assert plan.total_params == pytest.approx(671e9, rel=0.02)
    assert not [w for w in plan.warnings if "planner bug" in w]
    assert not any(n.startswith("multi-latent attention:") for n in plan.notes)  # its activations and traffic are modelled
