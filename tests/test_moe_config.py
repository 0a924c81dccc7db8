"""The MoE keys of [model] and [parallel] expert_model_parallel_size: Megatron's names and
defaults, and each bad combination refused as one line naming the key, the value and the rule."""

import subprocess
import sys
from pathlib import Path

import pytest

from dtgpt.config import Config, load_config, to_toml, validate
from tests import test_config

REPO = Path(__file__).resolve().parents[1]
MOE = {"model__num_experts": 4, "model__moe_router_topk": 2}


def base(**overrides) -> Config:
    return test_config.base(**{**MOE, **overrides})


error_of = test_config.error_of


def test_megatron_defaults_and_layer_pattern():
    m = Config().model
    assert m.num_experts is None and not m.moe_enabled and not m.is_moe_layer(0)
    assert (m.moe_router_topk, m.moe_router_score_function, m.moe_router_load_balancing_type) == (2, "softmax", "aux_loss")
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_expert_capacity_factor) == (0.0, None, None)
    assert (m.moe_router_bias_update_rate, m.moe_token_drop_policy, m.moe_layer_freq) == (1e-3, "probs", 1)
    assert Config().parallel.expert_model_parallel_size == 1
    cfg = base(model__moe_layer_freq=2, model__num_layers=4, model__ffn_hidden_size=96)
    assert [cfg.model.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert cfg.model.expert_ffn_size == 96  # unset moe_ffn_hidden_size: the dense width, as Megatron
    cfg.model.moe_ffn_hidden_size = 32
    assert cfg.model.expert_ffn_size == 32
    validate(cfg, 1)
    validate(base(training__compile=True, model__moe_router_dtype="fp32"), 1)  # compiled looped experts, dropless


def test_keys_round_trip_through_toml_and_the_command_line(tmp_path):
    path = tmp_path / "moe.toml"
    path.write_text(to_toml(base(model__moe_expert_capacity_factor=1.5)))
    cfg = load_config(path, ["--model.moe_router_score_function=sigmoid", "--parallel.expert_model_parallel_size=1"])
    assert cfg.model.num_experts == 4 and cfg.model.moe_expert_capacity_factor == 1.5
    assert cfg.model.moe_router_score_function == "sigmoid"


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        ({"model__moe_router_topk": 5}, None, "model.moe_router_topk=5 must be in [1, model.num_experts=4]"),
        ({"model__num_experts": 0}, None, "model.num_experts=0 must be >= 1"),
        ({"parallel__expert_model_parallel_size": 3}, None, "parallel.expert_model_parallel_size=3 must divide model.num_experts=4"),
        ({"parallel__expert_model_parallel_size": 4}, 2, "expert_model_parallel_size=4 must divide data_parallel_shard_size=2 * context_parallel_size=1"),
        ({"model__num_experts": None, "parallel__expert_model_parallel_size": 2}, None, "needs model.num_experts"),
        ({"parallel__tensor_model_parallel_size": 2, "model__ffn_hidden_size": 128}, 2, "needs parallel.sequence_parallel=true"),
        ({"model__moe_router_score_function": "relu"}, None, "model.moe_router_score_function='relu' is not one of"),
        ({"model__moe_router_load_balancing_type": "sinkhorn"}, None, "model.moe_router_load_balancing_type='sinkhorn'"),
        ({"model__moe_router_enable_expert_bias": True}, None, "needs model.moe_router_score_function='sigmoid'"),
        ({"model__moe_pad_expert_input_to_capacity": True}, None, "needs model.moe_expert_capacity_factor"),
        ({"model__moe_expert_capacity_factor": 0.0}, None, "model.moe_expert_capacity_factor=0.0 must be > 0"),
        ({"model__moe_aux_loss_coeff": -1.0}, None, "model.moe_aux_loss_coeff=-1.0 must be >= 0"),
        ({"model__moe_router_topk": 1}, None, "model.moe_router_topk=1 with model.moe_router_score_function='softmax' needs"),
        ({"model__moe_layer_freq": 0}, None, "model.moe_layer_freq=0 must be >= 1"),
        ({"model__moe_router_dtype": "bf16"}, None, "model.moe_router_dtype='bf16' is not one of: None, 'fp32', 'fp64'"),
        ({"training__compile": True, "model__moe_grouped_gemm": True}, None, "training.compile=true is not supported with model.moe_grouped_gemm=true"),
        (
            {"training__compile": True, "parallel__tensor_model_parallel_size": 2, "parallel__sequence_parallel": True},
            2, "no parity test covers compiled MoE blocks under tp",
        ),  # fmt: skip
        (
            {"model__moe_expert_capacity_factor": 1.0, "parallel__tensor_model_parallel_size": 2,
             "parallel__sequence_parallel": True},
            2, "capacity is counted over the tokens a rank holds",
        ),  # fmt: skip
    ],
)
def test_bad_moe_configs_name_key_value_and_rule(overrides, world, expected):
    assert expected in error_of(base(**overrides), world)


@pytest.mark.slow
def test_train_py_prints_one_error_line():
    for flags, expected in [
        (["--model.moe_router_topk=8"], "model.moe_router_topk=8 must be in [1, model.num_experts=4]"),
        (["--parallel.expert_model_parallel_size=3"], "parallel.expert_model_parallel_size=3 must divide model.num_experts=4"),
    ]:
        out = subprocess.run(
            [sys.executable, str(REPO / "train.py"), "--config", "configs/debug.toml", "--model.num_experts=4", *flags],
            capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], out.stderr
