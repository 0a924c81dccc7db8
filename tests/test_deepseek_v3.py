"""configs/deepseek_v3.toml: DeepSeek-V3's published architecture, counted and planned.

The dry-run's count (the planner builds every kind of rank on meta and checks the built count
against dtgpt/model_size.py's closed form) is DeepSeek's 671B, ~37B active per token; the FLOPs
per token are Megatron-LM's num_floating_point_operations for multi-latent attention and
dense-first MoE (written out below from its formula: megatron.training is not in the installed
package), for DeepSeek-V3 and for a model without the compressed query."""

import dataclasses

import pytest

from dtgpt.config import load_config
from dtgpt.model_size import flops_per_token, mtp_parameters, num_parameters
from tests.runs import REPO

CONFIG = str(REPO / "configs" / "deepseek_v3.toml")


def megatron_flops_per_token(m, vocab: int) -> float:
    """Megatron-LM's num_floating_point_operations / (batch x seq) for MLA + MoE, with its MTP
    terms: the prediction modules' blocks counted as blocks of the last block's kind (L grows by
    them), their norms (3h) and eh_proj (2h^2), and one logit layer per module."""
    h, nh, s = m.hidden_size, m.num_attention_heads, m.seq_length
    mtp = m.mtp_num_layers or 0
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    moe = sum(m.is_moe_layer(i) for i in range(m.num_layers)) + m.is_moe_layer(m.num_layers - 1) * mtp
    L = m.num_layers + mtp
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
    return mlp + self_attn + 6 * mtp * (3 * h + 2 * h * h) + 6 * h * vocab * (mtp + 1)


def test_deepseek_v3_counts_and_flops_are_megatrons():
    m = load_config(CONFIG).model
    assert num_parameters(m, 129280) == pytest.approx(671e9, rel=0.02)
    assert num_parameters(m, 129280, active=True) == pytest.approx(37e9, rel=0.02)
    assert m.mtp_num_layers == 1  # DeepSeek-V3's one prediction module, counted apart
    assert mtp_parameters(m) == pytest.approx(11.6e9, rel=0.02)  # DeepSeek's 14B less the shared embedding and head
    assert flops_per_token(m, 129280) == pytest.approx(megatron_flops_per_token(m, 129280), rel=1e-12)
    assert flops_per_token(m, 129280) > flops_per_token(dataclasses.replace(m, mtp_num_layers=None), 129280)
    for without in (dict(mtp_num_layers=None), dict(mtp_num_layers=2, moe_layer_freq="([1]*60+[0]*1)")):
        other = dataclasses.replace(m, **without)  # none, and two dense ones
        assert flops_per_token(other, 129280) == pytest.approx(megatron_flops_per_token(other, 129280), rel=1e-12)
    no_compression = dataclasses.replace(m, q_lora_rank=None, qk_layernorm=False)
    assert flops_per_token(no_compression, 129280) == pytest.approx(megatron_flops_per_token(no_compression, 129280), rel=1e-12)


@pytest.mark.slow
def test_dry_run_counts_671b():
    """What `train.py --config configs/deepseek_v3.toml --dry-run` prints, from the ranks it builds."""
    from dtgpt.plan import plan_layout

    plan = plan_layout(load_config(CONFIG))
    assert plan.world_size == 1024 and plan.mesh["ep"] == 64
    assert plan.total_params == pytest.approx(671e9, rel=0.02)  # multi-token prediction apart
    assert plan.mtp_params == mtp_parameters(plan_cfg := load_config(CONFIG).model) and plan_cfg.mtp_num_layers == 1
    assert not [w for w in plan.warnings if "planner bug" in w]
    assert not any(n.startswith("multi-latent attention:") for n in plan.notes)  # its activations and traffic are modelled
