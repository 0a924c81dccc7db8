"""model.moe_per_layer_logging: each MoE layer's router losses under Megatron's tags
`moe/<loss>_layer_<i>`, from the same one all-reduced vector (longer by a row per layer), whose
values average to the logged total; off, the vector and the record are as before."""

import dataclasses

import pytest
import torch

from dtgpt.config import ModelConfig
from dtgpt.config import LoggingConfig
from dtgpt.metrics import MetricsLogger, check_record, metrics_json_line
from dtgpt.model import GPT
from dtgpt.moe.stats import RoutingStats, moe_layers
from dtgpt.plan.comm import CommLayout
from dtgpt.plan.comm_moe import routing_stats_numel

CFG = ModelConfig(num_layers=3, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, seq_length=8, num_experts=4,
                  moe_router_topk=2, moe_layer_freq=1, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)  # fmt: skip


def routed(cfg: ModelConfig, microbatches: int = 2):
    """The summary of `microbatches` training forwards of a seeded model, and the reduced vector."""
    torch.manual_seed(0)
    model = GPT(cfg, vocab_size=64)
    model.init_weights(seed=3)
    for layer in moe_layers([model]).values():  # a spread of logits: losses that differ by layer
        torch.nn.init.normal_(layer.router.weight, std=0.5)
    tokens = torch.randint(0, 64, (microbatches, 2, 8), generator=torch.Generator().manual_seed(1))
    for micro in tokens:
        model(micro)
    stats = RoutingStats(cfg)
    vector = stats.local([model], torch.device("cpu"))
    assert vector.numel() == stats.size
    return stats.summary(vector.tolist(), microbatches), vector


def test_per_layer_values_average_to_the_logged_total():
    total, vector = routed(CFG)
    per_layer, longer = routed(dataclasses.replace(CFG, moe_per_layer_logging=True))
    assert longer.numel() == vector.numel() + 2 * (3 - 1)  # two losses, a row per further layer
    for name in ("load_balancing_loss", "z_loss"):
        values = [per_layer[f"moe/{name}_layer_{i}"] for i in range(3)]
        assert len(set(values)) == 3  # each layer its own
        assert sum(values) / 3 == pytest.approx(total[name], rel=1e-6)
        assert per_layer[name] == pytest.approx(total[name], rel=1e-6)
    assert not any(key.startswith("moe/") for key in total)
    assert per_layer["tokens_per_expert"] == total["tokens_per_expert"]


def test_per_layer_losses_are_recorded_and_counted_by_the_planner(tmp_path, capsys):
    per_layer, _ = routed(dataclasses.replace(CFG, moe_per_layer_logging=True))
    record = dict(iteration=1, consumed_samples=4, loss=1.0, lr=1e-4, grad_norm=1.0, loss_scale=1.0, global_batch_size=4,
                  skipped=0, nan=0, tokens_per_s=None, tflops_per_gpu=None, mfu=None, elapsed_ms=None, **per_layer)  # fmt: skip
    check_record(record)
    assert '"moe/z_loss_layer_2": ' in metrics_json_line(record)
    with pytest.raises(ValueError, match="moe/z_loss_layer_x"):
        check_record({**record, "moe/z_loss_layer_x": 1.0})
    check_tensorboard(record, tmp_path)
    layout = dict(num_layers=3, experts=4, load_balancing="aux_loss", aux_loss_coeff=1e-2, z_loss=True, layer_counts=(3,))
    off = routing_stats_numel(CommLayoutStub(**layout))
    on = routing_stats_numel(CommLayoutStub(**layout, per_layer_logging=True))
    assert (off, on) == (RoutingStats(CFG).size, RoutingStats(dataclasses.replace(CFG, moe_per_layer_logging=True)).size)


def CommLayoutStub(**fields):
    """A CommLayout with only the MoE fields the routing statistics' count reads."""
    defaults = {f.name: None for f in dataclasses.fields(CommLayout) if f.default is dataclasses.MISSING}
    return CommLayout(**{**defaults, "pp": 1, "stages_per_rank": 1, **fields})


def check_tensorboard(record: dict, tmp_path) -> None:
    """The per-layer losses reach TensorBoard under Megatron's tags, as recorded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(LoggingConfig(log_interval=1, tensorboard_dir=str(tmp_path)), total_iters=1, is_logging_rank=True)
    logger.log(record)
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for i in range(3):
        tag = f"moe/load_balancing_loss_layer_{i}"
        assert [e.value for e in events.Scalars(tag)] == [pytest.approx(record[tag], rel=1e-6)]
