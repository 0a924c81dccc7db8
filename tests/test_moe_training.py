"""An MoE model trains through train.py: the router's load-balancing loss steers the trajectory
(moe_aux_loss_coeff changes it) and is logged as Megatron logs it, in the log line and
TensorBoard, with tokens per expert and dropped tokens in the metrics file."""

import pytest

from tests.runs import TINY, Command, launch_commands, read_metrics

MOE = ["--model.num_layers=2", "--model.num_experts=4", "--model.moe_router_topk=2", "--model.moe_ffn_hidden_size=64",
       "--training.train_iters=4", "--logging.log_interval=2"]  # fmt: skip


def _command(tmp_path, name: str, *args: str) -> Command:
    return Command(name, tmp_path, [*TINY, *MOE, *args, f"--logging.metrics_file={tmp_path / f'{name}.jsonl'}"])


@pytest.mark.slow
def test_aux_loss_coeff_changes_the_trajectory_and_is_logged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    finished = launch_commands([  # both runs in one launch
        _command(tmp_path, "weighted", "--model.moe_aux_loss_coeff=1.0", "--model.moe_expert_capacity_factor=1.0", f"--logging.tensorboard_dir={tb}"),
        _command(tmp_path, "plain", "--model.moe_aux_loss_coeff=0.0", "--model.moe_expert_capacity_factor=1.0"),
    ])  # fmt: skip
    out, _ = finished["weighted"].checked(), finished["plain"].checked()
    weighted, plain = read_metrics(tmp_path / "weighted.jsonl"), read_metrics(tmp_path / "plain.jsonl")
    assert weighted[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)  # the same start: only training differs
    assert weighted[-1]["loss"] != pytest.approx(plain[-1]["loss"], rel=1e-4)
    assert "load_balancing_loss" not in plain[0]  # no weight, nothing logged, as Megatron
    lines = [line for line in out.splitlines() if "iteration        4/" in line]
    assert len(lines) == 1 and "| lm loss: " in lines[0] and "| load_balancing_loss: " in lines[0]
    for record in weighted:
        assert len(record["tokens_per_expert"]) == 2 and len(record["tokens_per_expert"][0]) == 4
        # capacity ceil(32 tokens * 2 / 4) = 16 per expert and micro-batch: what is routed and dropped
        # adds up to every token's two choices, 8 micro-batches x 32 tokens x 2 layers
        assert sum(map(sum, record["tokens_per_expert"])) + record["dropped_tokens"] == 8 * 32 * 2 * 2
        assert max(max(layer) for layer in record["tokens_per_expert"]) <= 8 * 16
    acc = EventAccumulator(str(tb))
    acc.Reload()
    logged = [event.value for event in acc.Scalars("load_balancing_loss")]
    assert logged == pytest.approx([r["load_balancing_loss"] for r in weighted], rel=1e-6)
