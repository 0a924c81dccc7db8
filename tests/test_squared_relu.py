"""Megatron's --squared-relu against megatron-core's own MLP (the local layer spec's
ColumnParallelLinear -> squared_relu -> RowParallelLinear) on one rank: the same weights give the
same output and the same gradients; and the flag sets the key a Megatron launch script expects."""

from __future__ import annotations

import pytest
import torch

from dtgpt.config import load_config
from dtgpt.config.sections import ConfigError, ModelConfig
from dtgpt.mlp import MLP

HIDDEN, FFN = 16, 40


def megatron_mlp(directory: str):
    """megatron-core's MLP with squared_relu, its output with the bias fc2 leaves to the caller added."""
    from megatron.core import parallel_state
    from megatron.core.activations import squared_relu
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP as MegatronMLP
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
                               activation_func=squared_relu, bias_activation_fusion=False, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False, add_bias_linear=True)  # fmt: skip
    torch.manual_seed(0)
    return MegatronMLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), ffn_hidden_size=FFN)


def test_squared_relu_mlp_is_megatrons(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    from tests.megatron_oracle import one_rank_group

    with one_rank_group(str(tmp_path)):
        theirs = megatron_mlp(str(tmp_path))
        try:
            ours = MLP(ModelConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2, squared_relu=True))
            with torch.no_grad():
                for mine, megatron in ((ours.fc1, theirs.linear_fc1), (ours.fc2, theirs.linear_fc2)):
                    mine.weight.copy_(megatron.weight)
                    mine.bias.copy_(megatron.bias.uniform_(-0.5, 0.5))  # non-zero, so a missed bias shows
            x = torch.randn(5, 3, HIDDEN)  # (T, B, h): Megatron's layout, token-wise for both
            out, bias = theirs(x)
            expected = out + bias if bias is not None else out
            got = ours(x)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
            expected.square().sum().backward()
            got.square().sum().backward()
            for mine, megatron in ((ours.fc1, theirs.linear_fc1), (ours.fc2, theirs.linear_fc2)):
                torch.testing.assert_close(mine.weight.grad, megatron.weight.grad, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(mine.bias.grad, megatron.bias.grad, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(got, ours.fc2(torch.nn.functional.gelu(ours.fc1(x))))  # not the GeLU
        finally:
            parallel_state.destroy_model_parallel()


def test_the_flag_sets_the_key_and_refuses_experts():
    assert load_config(None, ["--mock-data", "--squared-relu"]).model.squared_relu
    with pytest.raises(ConfigError, match="dtgpt's experts are GeLU or SwiGLU"):
        load_config(None, ["--mock-data", "--squared-relu", "--num-experts", "4"])


def test_a_megatron_checkpoints_squared_relu_is_its_architecture():
    """Megatron-LM's args with squared_relu: a GeLU config is told to set it, use_checkpoint_args
    takes it, and the args dtgpt writes for Megatron carry it."""
    from argparse import Namespace

    from dtgpt.checkpoint.architecture import difference, megatron_architecture, megatron_args, with_megatron_architecture

    args = Namespace(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=FFN, swiglu=False,
                     add_bias_linear=True, normalization="LayerNorm", squared_relu=True)  # fmt: skip
    gelu = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=FFN)
    assert "model.squared_relu: the checkpoint has true but the config has false" in difference(megatron_architecture(args), gelu)
    taken = with_megatron_architecture(args, gelu)
    assert taken.squared_relu and difference(megatron_architecture(args), taken) is None
    assert megatron_args(taken)["squared_relu"] is True
