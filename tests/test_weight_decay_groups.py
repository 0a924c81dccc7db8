"""Which parameters decay: megatron-core's _get_param_groups is the oracle, on the same model under
Megatron's parameter names, for Megatron's default rule and for apply_wd_to_qk_layernorm (its
--apply-wd-to-qk-layernorm, and the deprecated --no-weight-decay-cond-type that sets it), with
query/key norms; multi-latent attention's norms, whose fate depends on Megatron's layer spec, are
refused with the flag. And build_optimizer builds only non-empty groups, so a pipeline stage that
holds the embedding alone saves and loads its AdamW state.
"""

from __future__ import annotations

import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes on its absent GPU kernels
    from megatron.core import optimizer as mcore_optimizer

from dtgpt.checkpoint.megatron.keys import megatron_name
from dtgpt.config import Config, ConfigError, ModelConfig, OptimizerConfig, validate
from dtgpt.config.megatron_flags import translate
from dtgpt.model import GPT
from dtgpt.optim import WD_MULT, build_optimizer
from tests.megatron_mla_gpt import TE_NORM_NAMES
from tests.megatron_oracle import one_rank_group

SMALL = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, max_position_embeddings=8)
QK_LAYERNORM = dict(SMALL, qk_layernorm=True)  # LayerNorm: the q/k norms have a weight and a bias
MLA = dict(SMALL, qk_layernorm=True, multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=8, position_embedding_type="rope", normalization="RMSNorm")  # fmt: skip


class _Named:
    """A model chunk for megatron-core: `model`'s parameters under the names Megatron gives them."""

    def __init__(self, model: GPT, mla: bool, local_spec: bool):
        self.pairs = []
        for name, param in model.named_parameters():
            theirs = megatron_name(name, mla=mla, per_layer=True)[0] if name.startswith("layers.") else name
            if local_spec:  # Megatron's local layers keep the attention norms as modules of their own
                for local, te in TE_NORM_NAMES.items():
                    theirs = theirs.replace(te, local)
            self.pairs.append((theirs, param))

    def named_parameters(self):
        return iter(self.pairs)


def _wd_mults(model: GPT, apply: bool, tmp_path, *, mla: bool = False, local_spec: bool = False) -> dict[int, float]:
    """megatron-core's wd_mult of each parameter of `model`, by identity."""
    config = mcore_optimizer.OptimizerConfig(lr=1e-3, weight_decay=0.1, apply_wd_to_qk_layernorm=apply)
    with one_rank_group(str(tmp_path)):
        groups = mcore_optimizer._get_param_groups([_Named(model, mla, local_spec)], config, None)
    return {id(p): g["wd_mult"] for g in groups for p in g["params"]}


def _ours(model: GPT, apply: bool) -> dict[int, float]:
    optimizer = build_optimizer(model.named_parameters(), OptimizerConfig(weight_decay=0.1, apply_wd_to_qk_layernorm=apply))
    for g in optimizer.param_groups:
        assert g["weight_decay"] == 0.1 * g[WD_MULT]
    return {id(p): g[WD_MULT] for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("apply", [False, True], ids=["default", "apply_wd_to_qk_layernorm"])
def test_qk_layernorm_decay_follows_megatron(tmp_path, apply):
    model = GPT(ModelConfig(**QK_LAYERNORM), 32)
    ours, theirs = _ours(model, apply), _wd_mults(model, apply, tmp_path)
    assert ours == theirs
    q_norm = model.layers["0"].attention.q_norm
    assert ours[id(q_norm.weight)] == ours[id(q_norm.bias)] == float(apply)


def test_mla_norms_never_decay_by_default_and_the_flag_is_refused(tmp_path):
    """Without the flag, Megatron's groups of the MLA model are dtgpt's under either layer spec.
    With it, the two specs disagree on the query norm, so dtgpt refuses the combination."""
    model = GPT(ModelConfig(**MLA), 32)
    ours = _ours(model, apply=False)
    for local_spec in (False, True):
        assert ours == _wd_mults(model, False, tmp_path, mla=True, local_spec=local_spec)
    q = id(model.layers["0"].attention.q_layernorm.weight)
    te, local = (_wd_mults(model, True, tmp_path, mla=True, local_spec=s)[q] for s in (False, True))
    assert (te, local) == (0.0, 1.0)
    with pytest.raises(ConfigError, match="optimizer.apply_wd_to_qk_layernorm=true is refused with model.multi_latent_attention=true"):
        validate(Config(model=ModelConfig(**MLA), optimizer=OptimizerConfig(apply_wd_to_qk_layernorm=True)))


@pytest.mark.parametrize(
    "flags", [["--apply-wd-to-qk-layernorm"], ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"],
              ["--no-weight-decay-cond-type=apply_wd_to_qk_layernorm"]],
)  # fmt: skip
def test_megatron_flags_set_the_key(flags):
    assert [o[:2] for o in translate(flags).overrides] == [("optimizer.apply_wd_to_qk_layernorm", "true")]


def test_other_cond_type_is_refused():
    with pytest.raises(ConfigError, match="^--no-weight-decay-cond-type=qwen3_next is not one of Megatron's values: apply_wd_to_qk_layernorm$"):
        translate(["--no-weight-decay-cond-type", "qwen3_next"])


def _embedding_alone() -> GPT:
    """The first pipeline stage of layout E|t*2L: the word and position embeddings, both matrices."""
    part = GPT(ModelConfig(**SMALL), 32)
    part.layers, part.norm, part.output = torch.nn.ModuleDict(), None, None
    return part


def assert_state_round_trips(part: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """A step of `part`'s AdamW, then its flattened state (the checkpoint's) loads into a new one."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from dtgpt.state import FLAT_OPTIM

    optimizer = build_optimizer(part.named_parameters(), cfg)
    for p in part.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad()
    again = build_optimizer(part.named_parameters(), cfg)
    get_optimizer_state_dict(part, again, options=FLAT_OPTIM)  # creates its state, as TrainState.load_request does
    set_optimizer_state_dict(part, again, get_optimizer_state_dict(part, optimizer, options=FLAT_OPTIM), options=FLAT_OPTIM)
    for p in part.parameters():
        assert all(torch.equal(again.state[p][k], optimizer.state[p][k]) for k in ("exp_avg", "exp_avg_sq"))
    return again


@pytest.mark.parametrize("decoupled_lr", [None, 1e-2], ids=["two_groups", "decoupled"])
def test_only_non_empty_groups_and_an_embedding_stage_round_trips(decoupled_lr):
    """The embedding stage has no bias or norm: no group for them (one group, or the decoupled
    word embedding's beside the position embedding's), and its state loads."""
    optimizer = assert_state_round_trips(_embedding_alone(), OptimizerConfig(decoupled_lr=decoupled_lr))
    assert [g[WD_MULT] for g in optimizer.param_groups] == [1.0] * (1 + (decoupled_lr is not None))
