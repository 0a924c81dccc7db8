"""Recomputation with Megatron's meanings: which blocks, the same gradients, less memory, the rules."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from dtgpt.config import Config, ConfigError, load_config
from dtgpt.model import GPT
from dtgpt.parallel import ParallelDims, build_model_parts
from dtgpt.parallel.pipeline import build_stage_model
from dtgpt.parallel.recompute import (
    RecomputedGroup,
    apply_recompute,
    block_recompute,
    largest_recompute_group,
    recompute_groups,
)
from dtgpt.step import local_forward_backward

SETTINGS = {
    "none": (None, None, None),
    "selective": ("selective", None, None),
    "full_uniform_1": ("full", "uniform", 1),
    "full_uniform_2": ("full", "uniform", 2),
    "full_block_1": ("full", "block", 1),
}

# -- which blocks --------------------------------------------------------------------------------


def test_uniform_groups_every_block_in_chunks_of_n():
    names = ["0", "1", "2", "3", "4"]
    assert recompute_groups(names, "uniform", 1) == [["0"], ["1"], ["2"], ["3"], ["4"]]
    assert recompute_groups(names, "uniform", 2) == [["0", "1"], ["2", "3"], ["4"]]  # the last is shorter
    assert recompute_groups(names, "uniform", 9) == [names]


def test_block_recomputes_the_first_n_blocks_one_by_one():
    names = ["4", "5", "6", "7"]  # a pipeline stage's blocks keep their global names
    assert recompute_groups(names, "block", 2) == [["4"], ["5"]]
    assert recompute_groups(names, "block", 9) == [[n] for n in names]


def _tiny(**model) -> Config:
    cfg = Config()
    cfg.model.num_layers = 4
    cfg.model.hidden_size = 32
    cfg.model.num_attention_heads = 4
    cfg.model.seq_length = 16
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.data.mock_data = True
    return cfg


def test_block_counts_within_each_pipeline_stage():
    """Megatron's 'block' method: the first n blocks of *each stage*, not of the whole model."""
    with torch.device("meta"):
        whole = GPT(_tiny().model, 64)
    stages = [build_stage_model(whole, s, [2, 2]) for s in range(2)]
    for stage in stages:
        apply_recompute(stage, "full", "block", 1)
    assert block_recompute(stages[0]) == {"0": "full", "1": "none"}
    assert block_recompute(stages[1]) == {"2": "full", "3": "none"}
    # the forward still runs every block, in order: the recomputed group, then the plain block
    runs = stages[1].block_runs
    assert isinstance(runs[0], RecomputedGroup) and runs[0].names == ["2"] and runs[1] is stages[1].layers["3"]


def test_uniform_groups_and_selective_as_the_planner_reads_them():
    with torch.device("meta"):
        uniform, selective = GPT(_tiny().model, 64), GPT(_tiny().model, 64)
    apply_recompute(uniform, "full", "uniform", 3)
    assert [r.names for r in uniform.block_runs] == [["0", "1", "2"], ["3"]]
    assert set(block_recompute(uniform).values()) == {"full"} and largest_recompute_group(uniform) == 3
    apply_recompute(selective, "selective", None, None)
    assert set(block_recompute(selective).values()) == {"selective"} and largest_recompute_group(selective) == 0
    assert selective.block_runs is None


def test_recomputation_keeps_parameter_names():
    """Checkpoints, the optimizer and the seeded init all key on these names."""
    with torch.device("meta"):
        plain = GPT(_tiny().model, 64)
    names = [n for n, _ in plain.named_parameters()]
    for granularity, method, n in SETTINGS.values():
        with torch.device("meta"):
            model = GPT(_tiny().model, 64)
        apply_recompute(model, granularity, method, n)
        assert [name for name, _ in model.named_parameters()] == names


# -- the same numbers ----------------------------------------------------------------------------


def _built(setting: str, cfg: Config):
    """One process's model for `cfg` under a recompute setting, through parallelize()."""
    t = cfg.training
    t.recompute_granularity, t.recompute_method, t.recompute_num_layers = SETTINGS[setting]
    with torch.device("meta"):
        whole = GPT(cfg.model, 64)
    return build_model_parts(cfg, ParallelDims.from_config(cfg, 1), whole, torch.device("cpu"))


def _loss_and_grads(setting: str, dropout: float):
    model = _built(setting, _tiny(hidden_dropout=dropout, attention_dropout=dropout))
    batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(123)  # the dropout masks
    loss = local_forward_backward(model, batch, 2)
    return loss, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "none"])
def test_recomputation_gives_the_same_gradients_with_dropout(setting):
    """The recomputed forward replays the forward's RNG state: the same dropout masks."""
    loss, grads = _loss_and_grads("none", dropout=0.1)
    loss_r, grads_r = _loss_and_grads(setting, dropout=0.1)
    assert loss_r.item() == loss.item()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-6, atol=1e-7, msg=name)


# -- less memory ---------------------------------------------------------------------------------


def _allocation_totals(events):
    for event in events:
        if type(event.extra_fields).__name__ == "_ExtraFields_Allocation":
            yield event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.total_allocated
        yield from _allocation_totals(event.children)


def peak_allocated_bytes(step) -> int:
    """The peak of CPU bytes allocated during step(), above what was allocated when it started.

    The profiler (profile_memory=True) records every allocation and free of the CPU allocator
    with its running total; its event tree is where torch exposes that total for the CPU (there
    is no torch.cuda.max_memory_allocated for it). No timing is involved.
    """
    # acc_events: one cycle either way; it only stops torch 2.11's warning that a new cycle clears events
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        step()
    events = sorted(_allocation_totals(prof.profiler.kineto_results.experimental_event_tree()), key=lambda e: e[0])
    _, first_size, first_total = events[0]
    return max(total for _, _, total in events) - (first_total - first_size)


def _peak_activation_bytes(setting: str) -> int:
    """One forward-backward of a model whose attention scores dominate: seq 256, hidden 32, 8 heads."""
    cfg = _tiny(num_layers=4, hidden_size=32, num_attention_heads=8, seq_length=256, hidden_dropout=0.0, attention_dropout=0.0)
    model = _built(setting, cfg)
    batch = torch.randint(0, 64, (2, 257), generator=torch.Generator().manual_seed(0))
    # The math kernel keeps the (B, nh, T, T) attention probabilities for backward, as Megatron's
    # unfused core attention does; torch's CPU flash kernel (taken without dropout) keeps only
    # the output and the log-sum-exp, so there selective recomputation saves little.
    with sdpa_kernel(SDPBackend.MATH):
        return peak_allocated_bytes(lambda: local_forward_backward(model, batch, 1))


def test_selective_then_full_recomputation_lower_peak_activation_memory():
    peak = {s: _peak_activation_bytes(s) for s in ("none", "selective", "full_uniform_1", "full_block_1")}
    scores = 2 * 8 * 256 * 256 * 4  # one layer's attention probabilities, fp32: 4 MiB
    # selective keeps no layer's scores (it rebuilds one layer's at a time in backward)
    assert peak["none"] - peak["selective"] > 2 * scores, peak
    # full keeps only each block's input, not the rest of its activations
    assert peak["selective"] - peak["full_uniform_1"] > scores / 4, peak
    # 'block' with n=1 recomputes 1 block of 4: it saves that block's scores, not the others'
    assert peak["full_uniform_1"] < peak["full_block_1"] < peak["none"] - scores / 2, peak


# -- the rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--training.recompute_granularity=partial"], "training.recompute_granularity='partial' is not one of"),
        (["--training.recompute_granularity=full"], "training.recompute_granularity='full' needs training.recompute_method"),
        (["--training.recompute_granularity=full", "--training.recompute_method=uniform"],
         "needs training.recompute_method ('uniform' or 'block') and training.recompute_num_layers >= 1"),
        (["--training.recompute_granularity=full", "--training.recompute_method=every", "--training.recompute_num_layers=1"],
         "training.recompute_method='every' is not one of"),
        (["--training.recompute_granularity=full", "--training.recompute_method=block", "--training.recompute_num_layers=0"],
         "training.recompute_num_layers=0 must be >= 1"),
        (["--training.recompute_granularity=selective", "--training.recompute_method=uniform"],
         "training.recompute_method='uniform' applies only to training.recompute_granularity='full' ('selective'"),
        (["--training.recompute_granularity=selective", "--training.recompute_num_layers=2"],
         "training.recompute_num_layers=2 applies only to training.recompute_granularity='full'"),
        (["--training.recompute_method=block"], "applies only to training.recompute_granularity='full' (it is unset)"),
        (["--training.activation_checkpointing=full"], "unknown key --training.activation_checkpointing"),
    ],
)  # fmt: skip
def test_bad_recompute_settings_name_the_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--data.mock_data=true", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_megatrons_settings_load():
    for granularity, method, n in SETTINGS.values():
        args = [f"--training.recompute_{k}={v}" for k, v in (("granularity", granularity), ("method", method), ("num_layers", n)) if v]
        t = load_config(None, ["--data.mock_data=true", *args]).training
        assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == (granularity, method, n)
