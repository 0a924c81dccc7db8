"""AdamW groups, the batch-size ramp-up and the LR schedule against hand-computed values."""

import math
import re

import pytest
import torch
from torch import nn

from dtgpt.config import Config, OptimizerConfig, TrainingConfig
from dtgpt.config.batch_schedule import BatchSizeSchedule, total_train_samples
from dtgpt.optim import LRSchedule, build_optimizer

# ---------------------------------------------------------------------------------------------
# AdamW param groups


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


@pytest.mark.parametrize("fused", [False, True])
def test_param_groups(fused):
    model = _Tiny()
    cfg = OptimizerConfig(weight_decay=0.1, lr=1e-3, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    # remove_duplicate=False yields the tied weight under both names, as FSDP/PP code may.
    opt = build_optimizer(model.named_parameters(remove_duplicate=False), cfg, fused=fused)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert ids(decay) == {id(model.emb.weight), id(model.proj.weight)}
    assert ids(no_decay) == {id(model.norm.weight), id(model.norm.bias), id(model.proj.bias)}
    all_params = decay["params"] + no_decay["params"]
    assert len(all_params) == len({id(p) for p in all_params}) == 5
    assert decay["betas"] == (0.8, 0.95) and decay["eps"] == 1e-6 and decay["lr"] == 1e-3
    assert opt.defaults["fused"] is fused
    assert opt.defaults["foreach"] is (not fused)
    # The chosen kernel really runs on these groups.
    loss = model.head(model.proj(model.norm(model.emb(torch.tensor([1, 2]))))).sum()
    loss.backward()
    before = model.emb.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.emb.weight)


# ---------------------------------------------------------------------------------------------
# Batch-size ramp-up


def _gpt3_training(**kw):
    return TrainingConfig(global_batch_size=1536, rampup_batch_size=[16, 16, 5859375], **kw)


@pytest.mark.parametrize(
    "consumed, batch", [(0, 16), (61_677, 16), (61_678, 32), (3_000_000, 784), (5_859_374, 1520), (5_859_375, 1536), (10**9, 1536)]
)
def test_rampup_gpt3_175b(consumed, batch):
    assert BatchSizeSchedule(_gpt3_training()).global_batch_size(consumed) == batch


def _brute_force_samples(schedule, iters):
    consumed = 0
    for _ in range(iters):
        consumed += schedule.global_batch_size(consumed)
    return consumed


@pytest.mark.parametrize(
    "gbs, ramp, iters",
    [(64, [8, 8, 1000], 50), (64, [8, 8, 1000], 3), (48, [4, 4, 997], 200), (96, [32, 32, 100], 40),
     (30, [3, 3, 7], 20), (64, [], 17), (64, [64, 8, 1000], 9), (64, [8, 8, 0], 5)],
)
def test_total_train_samples_matches_loop(gbs, ramp, iters):
    cfg = TrainingConfig(global_batch_size=gbs, rampup_batch_size=ramp, train_iters=iters)
    schedule = BatchSizeSchedule(cfg)
    assert total_train_samples(cfg) == _brute_force_samples(schedule, iters)
    for i in range(iters + 1):
        assert schedule.consumed_samples(i) == _brute_force_samples(schedule, i)
    # Every batch size an iteration uses, in order, each once (the pipeline schedules and the
    # planner take their micro-batch counts from these).
    used, consumed = [], 0
    while not used or used[-1] != gbs:
        used.append(schedule.global_batch_size(consumed))
        consumed += used[-1]
    assert schedule.sizes() == sorted(set(used))


def test_total_train_samples_gpt3_175b_is_fast_and_exact():
    cfg = _gpt3_training(train_iters=500_000)
    schedule = BatchSizeSchedule(cfg)
    ramp_iters = consumed = last_batch = 0
    while consumed < 5_859_375:
        last_batch = schedule.global_batch_size(consumed)
        consumed += last_batch
        ramp_iters += 1
    assert schedule.consumed_samples(ramp_iters) == consumed
    assert last_batch == 1520  # the ramp climbs through every size...
    assert schedule.global_batch_size(consumed) == 1536  # ...and ends at the full one
    assert total_train_samples(cfg) == consumed + (500_000 - ramp_iters) * 1536


def test_no_rampup_is_constant():
    cfg = TrainingConfig(global_batch_size=24, train_iters=10)
    schedule = BatchSizeSchedule(cfg)
    assert [schedule.global_batch_size(c) for c in (0, 1, 23, 10**6)] == [24] * 4
    assert total_train_samples(cfg) == 240


# ---------------------------------------------------------------------------------------------
# LR schedule


def _cfg(train_iters=100, gbs=10, **optimizer):
    return Config(
        training=TrainingConfig(global_batch_size=gbs, train_iters=train_iters),
        optimizer=OptimizerConfig(**optimizer),
    )


def test_gpt3_175b_cosine():
    cfg = Config(
        training=_gpt3_training(train_iters=500_000),
        optimizer=OptimizerConfig(lr=6e-5, min_lr=6e-6, lr_decay_style="cosine", lr_warmup_fraction=0.001, lr_decay_iters=430_000),
    )
    s = LRSchedule(cfg)
    decay = 430_000 * 1536
    warmup = 0.001 * decay
    assert s.decay_steps == decay and s.warmup_steps == pytest.approx(660_480)
    assert s.lr_at(0) == 0.0
    assert s.lr_at(warmup / 2) == pytest.approx(3e-5, rel=1e-12)
    assert s.lr_at(warmup) == pytest.approx(6e-5, rel=1e-12)
    assert s.lr_at((warmup + decay) / 2) == pytest.approx((6e-5 + 6e-6) / 2, rel=1e-12)
    quarter = warmup + (decay - warmup) / 4
    assert s.lr_at(quarter) == pytest.approx(6e-6 + 0.5 * (math.cos(math.pi / 4) + 1) * 5.4e-5, rel=1e-12)
    assert s.lr_at(decay) == pytest.approx(6e-6, rel=1e-12)
    assert s.lr_at(decay + 1) == 6e-6
    assert s.lr_at(10**12) == 6e-6


def test_linear_with_warmup_iters_and_init():
    # decay = 100 iters * 10 = 1000 samples, warmup = 10 iters * 10 = 100 samples.
    s = LRSchedule(_cfg(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_warmup_init=0.5))
    assert (s.decay_steps, s.warmup_steps) == (1000, 100)
    assert s.lr_at(0) == 0.5
    assert s.lr_at(50) == pytest.approx(0.75)
    assert s.lr_at(100) == pytest.approx(1.0)
    assert s.lr_at(550) == pytest.approx(0.1 + 0.5 * 0.9)
    assert s.lr_at(1000) == pytest.approx(0.1)
    assert s.lr_at(1001) == 0.1


def test_lengths_precedence():
    assert LRSchedule(_cfg(lr_decay_samples=777, lr_decay_iters=5)).decay_steps == 777
    assert LRSchedule(_cfg(lr_decay_iters=5)).decay_steps == 50
    s = LRSchedule(_cfg(lr_warmup_samples=30, lr_warmup_iters=5))
    assert s.warmup_steps == 30
    s = LRSchedule(_cfg(lr_warmup_fraction=0.25, lr_warmup_samples=30))
    assert s.warmup_steps == 250


def test_constant_and_inverse_square_root():
    s = LRSchedule(_cfg(lr=2.0, min_lr=0.0, lr_decay_style="constant", lr_warmup_samples=40))
    assert [s.lr_at(n) for n in (20, 40, 500, 10**6)] == [1.0, 2.0, 2.0, 2.0]
    s = LRSchedule(_cfg(lr=2.0, min_lr=0.5, lr_decay_style="inverse-square-root", lr_warmup_samples=100))
    assert s.lr_at(100) == pytest.approx(2.0)
    assert s.lr_at(400) == pytest.approx(1.0)  # 2 * sqrt(100 / 400)
    assert s.lr_at(900) == pytest.approx(2.0 / 3.0)
    assert s.lr_at(1000) == pytest.approx(max(0.5, 2.0 * math.sqrt(0.1)))
    assert s.lr_at(1001) == 0.5  # beyond decay: min_lr
    no_warmup = LRSchedule(_cfg(lr=2.0, lr_decay_style="inverse-square-root"))
    assert no_warmup.lr_at(0) == 2.0 and no_warmup.lr_at(4) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "style, coeff",
    [
        ("linear", lambda r: 1 - r),
        ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
        ("exponential", lambda r: 2 * 0.5**r - 1),
        ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
    ],
)
def test_wsd(style, coeff):
    # decay 1000 samples, warmup 100, anneal the last 200 (lr_wsd_decay_iters=20 * gbs 10).
    s = LRSchedule(_cfg(lr=1.0, min_lr=0.2, lr_decay_style="WSD", lr_warmup_samples=100,
                        lr_wsd_decay_iters=20, lr_wsd_decay_style=style))
    assert s.wsd_decay_steps == 200
    assert s.lr_at(50) == pytest.approx(0.5)
    assert s.lr_at(101) == 1.0 and s.lr_at(800) == 1.0  # stable phase
    for n in (850, 900, 975, 1000):
        r = (n - 800) / 200
        assert s.lr_at(n) == pytest.approx(0.2 + 0.8 * coeff(r)), n
    assert s.lr_at(1000) == pytest.approx(0.2)
    assert s.lr_at(1200) == 0.2


def test_wsd_samples_key_wins():
    s = LRSchedule(_cfg(lr_decay_style="WSD", lr_wsd_decay_samples=123, lr_wsd_decay_iters=20))
    assert s.wsd_decay_steps == 123


def test_step_apply_and_resume():
    cfg = _cfg(lr=1.0, min_lr=0.0, lr_warmup_samples=100)
    s = LRSchedule(cfg)
    param = nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([("w", param)], cfg.optimizer)
    assert s.apply(opt) == 0.0 and all(g["lr"] == 0.0 for g in opt.param_groups)
    s.step(30)
    s.step(20)
    assert s.num_samples == 50 and s.current_lr == pytest.approx(0.5)
    assert s.apply(opt) == pytest.approx(0.5)
    assert all(g["lr"] == pytest.approx(0.5) for g in opt.param_groups)

    resumed = LRSchedule(cfg)
    resumed.load_state_dict(s.state_dict())
    assert resumed.current_lr == s.current_lr
    s.step(400)
    resumed.step(400)
    assert resumed.current_lr == s.current_lr == pytest.approx(1.0 - 350 / 900)


def test_apply_keeps_tensor_lr():
    s = LRSchedule(_cfg(lr=1.0, lr_warmup_samples=100))
    s.step(25)
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.0))
    s.apply(opt)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert opt.param_groups[0]["lr"].item() == pytest.approx(0.25)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = _cfg(lr=1.0, lr_decay_style="cosine", lr_warmup_samples=100)
    s = LRSchedule(cfg)
    s.step(640)
    dcp.save({"lr_schedule": s}, checkpoint_id=str(tmp_path))
    resumed = LRSchedule(cfg)
    dcp.load({"lr_schedule": resumed}, checkpoint_id=str(tmp_path))
    assert resumed.num_samples == 640 and resumed.current_lr == s.current_lr


def test_no_bias_and_no_norm_weight_decays_by_megatrons_rule():
    """Every parameter of a GPT with every kind of weight (biases, qk-norms, MoE with stacked
    expert biases, a shared expert, the router) against Megatron's rule applied to the tensor it
    maps to: no decay for a name ending in '.bias' or a 1-D tensor (each expert's own tensors,
    whose biases are 1-D, where dtgpt stacks them)."""
    from dtgpt.checkpoint.megatron.keys import megatron_name
    from dtgpt.config import ModelConfig
    from dtgpt.model import GPT
    from dtgpt.optim import decays

    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, seq_length=8,
                      add_bias_linear=True, qk_layernorm=True, num_experts=4, moe_layer_freq=2,
                      moe_shared_expert_intermediate_size=32)  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg, 64)
    checked = set()
    for name, param in model.named_parameters():
        megatron, _ = megatron_name(name)
        shape = param.shape[1:] if ".mlp.experts." in name else param.shape  # one expert's tensor
        assert decays(name, param) == (not (megatron.endswith(".bias") or len(shape) == 1)), (name, megatron)
        checked.add(name.split(".", 2)[-1])
    assert {"mlp.experts.fc1_bias", "mlp.router.weight", "attention.q_norm.weight", "mlp.fc1.bias"} <= checked
    assert not decays("layers.0.mlp.experts.fc2_bias", torch.empty(4, 16))  # 2-D, still a bias


# ---------------------------------------------------------------------------------------------
# Weight-decay schedule (Megatron's --start-weight-decay, --end-weight-decay, --weight-decay-incr-style)


def test_weight_decay_increments_over_the_whole_run_not_the_lr_decay():
    """1000 samples of training (100 iterations of 10), the LR decaying over 200 of them: the
    weight decay goes from start to end over all 1000, then stays at end."""
    linear = LRSchedule(_cfg(lr_decay_iters=20, weight_decay_incr_style="linear", start_weight_decay=0.1, end_weight_decay=0.3))
    assert linear.wd_incr_steps == 1000
    assert [linear.wd_at(n) for n in (0, 250, 1000, 5000)] == pytest.approx([0.1, 0.15, 0.3, 0.3])
    cosine = LRSchedule(_cfg(weight_decay_incr_style="cosine", start_weight_decay=0.0, end_weight_decay=0.2))
    assert [cosine.wd_at(n) for n in (0, 500, 1000)] == pytest.approx([0.0, 0.1, 0.2])
    assert cosine.wd_at(250) == pytest.approx(0.1 * (1 - math.cos(math.pi / 4)))  # slow start: 0.0293
    by_samples = LRSchedule(Config(training=TrainingConfig(train_samples=640, train_iters=None, global_batch_size=8),
                                   optimizer=OptimizerConfig(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1)))  # fmt: skip
    assert by_samples.wd_incr_steps == 640 and by_samples.wd_at(320) == pytest.approx(0.05)
    constant = LRSchedule(_cfg(weight_decay=0.07))
    assert (constant.start_wd, constant.end_wd, constant.wd_at(0), constant.wd_at(10**6)) == (0.07, 0.07, 0.07, 0.07)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_apply_sets_each_groups_weight_decay_by_its_wd_mult(kind):
    """Matrices get the schedule's weight decay, biases and norms 0; the torch optimizer then
    decays by it (a zero gradient: the step is the decay alone)."""
    cfg = _cfg(lr=0.5, lr_decay_style="constant", optimizer=kind, sgd_momentum=0.0,
               weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.2)  # fmt: skip
    matrix, bias = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))
    opt, s = build_optimizer([("w", matrix), ("b", bias)], cfg.optimizer), LRSchedule(cfg)
    s.step(500)
    s.apply(opt)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == pytest.approx([0.0, 0.1])
    for p in (matrix, bias):
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(matrix, torch.full((2, 2), 1 - 0.5 * 0.1)) and torch.equal(bias, torch.ones(2))
    mine = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], weight_decay=0.3)  # a library user's own group
    s.apply(mine)
    assert mine.param_groups[0]["weight_decay"] == 0.3


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(start_weight_decay=0.1), "optimizer.start_weight_decay=0.1 is set but optimizer.weight_decay_incr_style='constant'"),
        (dict(weight_decay_incr_style="linear", end_weight_decay=0.1), "'linear' needs optimizer.start_weight_decay"),
        (dict(weight_decay_incr_style="cosine", start_weight_decay=-0.1, end_weight_decay=0.1), "start_weight_decay=-0.1 must be >= 0"),
        (dict(weight_decay_incr_style="linear", start_weight_decay=0.2, end_weight_decay=0.1),
         "optimizer.end_weight_decay=0.1 must be >= optimizer.start_weight_decay=0.2"),
        (dict(weight_decay_incr_style="exponential"), "optimizer.weight_decay_incr_style='exponential' is not one of"),
        (dict(weight_decay=-0.01), "optimizer.weight_decay=-0.01 must be >= 0"),
    ],
)  # fmt: skip
def test_weight_decay_schedule_rules(keys, message):
    from dtgpt.config import ConfigError, DataConfig, validate

    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        validate(Config(data=DataConfig(mock_data=True), optimizer=OptimizerConfig(**keys)))
    assert "\n" not in str(error.value)
