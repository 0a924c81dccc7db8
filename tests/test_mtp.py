"""Multi-token prediction (dtgpt/mtp.py) against megatron-core's GPTModel with its MTP block
(local specs), on CPU in the test process (the patches of tests/megatron_moe.py): the same weights
(every name mapped by Megatron's key map, the MTP's own names equal) and the same tokens, labels
and loss mask give the same LM loss, the same per-depth MTP loss Megatron's tracker logs, and the
same gradient of every parameter, the MTP term included (Megatron's default loss, the micro-batch
mean, and calculate_per_token_loss; MTPLossAutoScaler's scale 1). Two depths, so that the second's doubly shifted labels, mask
and inputs are checked too; a masked label (eod_mask_loss) inside the sequence. Plus the config
rules, one line each."""

import pytest
import torch

from dtgpt.checkpoint.megatron.keys import GLOBAL_KEYS, LAYER_KEYS, LOCAL_NORM_NAMES
from dtgpt.config import Config, ConfigError, ModelConfig, validate
from dtgpt.data.batch import IGNORE_INDEX
from dtgpt.model import GPT
from dtgpt.mtp import MTPLoss, depth_labels, mtp_loss_key
from dtgpt.parallel.model_parts import GlobalBatchLoss
from tests.megatron_moe import megatron_session

HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH, DEPTH, FACTOR = 32, 4, 48, 64, 12, 2, 2, 0.3


@pytest.fixture
def megatron(monkeypatch):
    yield from megatron_session(monkeypatch)


def megatron_gpt(per_token: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        bias_activation_fusion=False, persist_layer_norm=False, mtp_num_layers=DEPTH, mtp_loss_scaling_factor=FACTOR,
        calculate_per_token_loss=per_token,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    torch.manual_seed(7)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False,
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))  # fmt: skip
    with torch.no_grad():  # norms away from one, weights large enough that a mix-up shows
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    return model


def dtgpt_gpt() -> GPT:
    cfg = ModelConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                      normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                      untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
                      mtp_num_layers=DEPTH, mtp_loss_scaling_factor=FACTOR)  # fmt: skip
    return GPT(cfg, VOCAB)


def megatron_key(name: str) -> tuple[str, slice]:
    """dtgpt name -> (Megatron's local-spec name, the rows of it): SwiGLU's gate and fc1 are the
    two halves of Megatron's linear_fc1."""
    if name in GLOBAL_KEYS:
        return GLOBAL_KEYS[name], slice(None)
    prefix, rest = name.split(".transformer_layer.") if ".transformer_layer." in name else (name, "")
    if name.startswith("mtp.") and not rest:
        return name, slice(None)  # enorm, hnorm, eh_proj, final_layernorm: Megatron's names
    if not rest:
        _, layer, rest = name.split(".", 2)
        prefix = f"decoder.layers.{layer}"
    else:
        prefix += ".transformer_layer"
    key = LAYER_KEYS[rest]
    rows = slice(None)
    if rest.startswith("mlp.gate") or rest.startswith("mlp.fc1"):
        rows = slice(0, FFN) if rest.startswith("mlp.gate") else slice(FFN, 2 * FFN)
    return f"{prefix}.{LOCAL_NORM_NAMES.get(key, key)}", rows


def take_megatron_weights(ours: GPT, theirs) -> tuple[dict, dict]:
    """Copy megatron-core's GPTModel's weights into dtgpt's model of the same shape: (Megatron's
    parameters by name, dtgpt name -> (Megatron name, rows)); every Megatron tensor is mapped once."""
    params = dict(theirs.named_parameters())
    mapped = {name: megatron_key(name) for name, _ in ours.named_parameters()}
    assert sorted({key for key, _ in mapped.values()}) == sorted(params), "every Megatron tensor mapped once"
    with torch.no_grad():
        for name, p in ours.named_parameters():
            key, rows = mapped[name]
            p.copy_(params[key][rows])
    return params, mapped


@pytest.mark.parametrize("per_token", [False, True], ids=["micro_batch_mean", "per_token"])
def test_mtp_matches_megatron(megatron, per_token):
    """per_token: calculate_per_token_loss, where Megatron sums token losses (the MTP term too)
    and divides the gradients by the LM loss tokens at the end."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    theirs, ours = megatron_gpt(per_token), dtgpt_gpt()
    params, mapped = take_megatron_weights(ours, theirs)
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[0, 4] = loss_mask[1, 9] = 0.0  # masked inside the sequence: depth k masks position t - k

    theirs.train()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    MTPLossLoggingHelper.tracker.clear()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    losses = theirs(tokens, positions, causal, labels=labels, loss_mask=loss_mask)  # (B, T)
    lm_theirs = (losses.float() * loss_mask).sum() / (1.0 if per_token else loss_mask.sum())
    lm_theirs.backward()
    if per_token:  # Megatron's finalize_model_grads: the summed gradients over the loss tokens
        for p in params.values():
            p.grad /= loss_mask.sum()
        lm_theirs = lm_theirs / loss_mask.sum()
    logged_theirs = MTPLossLoggingHelper.tracker["values"].clone()
    MTPLossLoggingHelper.tracker.clear()

    ours.train()
    ignored = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
    count = torch.full((BATCH, 1), float((ignored != IGNORE_INDEX).sum()))  # the micro-batch's count column
    mtp = MTPLoss(ours.cfg)
    if per_token:
        lm_ours = GlobalBatchLoss(count[0, 0], 1.0, mtp=mtp)(ours(tokens), ignored)
    else:
        loss_fn = GlobalBatchLoss(torch.tensor(1.0), 1.0, count_column=True, mtp=mtp)
        lm_ours = loss_fn(ours(tokens), torch.cat([ignored, count.to(labels.dtype)], dim=1))
    lm_ours.backward()

    torch.testing.assert_close(lm_ours, lm_theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mtp.take(torch.device("cpu")), logged_theirs, rtol=1e-5, atol=1e-6)
    for name, p in ours.named_parameters():
        key, rows = mapped[name]
        torch.testing.assert_close(p.grad, params[key].grad[rows], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert ours.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0


def test_mtp_term_is_in_the_gradient_not_the_value():
    """The returned loss is the LM loss; with the factor at 0 the MTP modules get no gradient."""
    torch.manual_seed(0)
    model = dtgpt_gpt()
    model.init_weights(seed=1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    lm = GlobalBatchLoss(torch.tensor(float(BATCH * SEQ)), 1.0)
    with_mtp = GlobalBatchLoss(torch.tensor(float(BATCH * SEQ)), 1.0, mtp=MTPLoss(model.cfg))
    outputs = model(tokens)
    assert len(outputs) == 1 + DEPTH
    assert with_mtp(outputs, tokens).item() == lm(outputs[0], tokens).item()
    model.train(False)
    assert isinstance(model(tokens), torch.Tensor)  # evaluation: the LM logits alone


def test_depth_labels_shift_and_mask_the_end():
    labels = torch.tensor([[1, 2, 3, IGNORE_INDEX, 5]])
    first, second = depth_labels(labels, 2)
    assert first.tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX]]
    assert second.tolist() == [[3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX]]
    assert mtp_loss_key(1) == "mtp_1 loss"


BAD = {
    "model.mtp_num_layers=0 must be >= 1": dict(mtp_num_layers=0),
    "model.mtp_loss_scaling_factor=-1.0 must be a finite number >= 0": dict(mtp_num_layers=1, mtp_loss_scaling_factor=-1.0),
    "model.mtp_loss_scaling_factor=0.3 needs model.mtp_num_layers": dict(mtp_loss_scaling_factor=0.3),
}


@pytest.mark.parametrize("expected", sorted(BAD))
def test_bad_mtp_config_is_one_line(expected):
    cfg = Config()
    for key, value in BAD[expected].items():
        setattr(cfg.model, key, value)
    cfg.data.mock_data = True
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_mtp_loss_is_logged_beside_the_lm_loss(tmp_path, capsys):
    """The metrics file, the console line (after lm loss, the interval's mean) and TensorBoard
    (Megatron's tag `mtp_1 loss`) carry each depth's loss."""
    import json

    from dtgpt.config import LoggingConfig
    from dtgpt.metrics import MetricsLogger
    from tests.test_metrics import _field, _record

    logger = MetricsLogger(LoggingConfig(log_interval=2, metrics_file=str(tmp_path / "m.jsonl")), 2, is_logging_rank=True)
    scalars = []
    logger.writer = type("Writer", (), {"add_scalar": lambda self, *a: scalars.append(a[:2])})()
    logger.log(_record(1, **{"mtp_1 loss": 3.0, "mtp_2 loss": 4.0}))
    logger.log(_record(2, **{"mtp_1 loss": 5.0, "mtp_2 loss": 6.0}))
    out = capsys.readouterr().out
    assert float(_field(out, "mtp_1 loss")) == 4.0 and float(_field(out, "mtp_2 loss")) == 5.0
    assert out.index("lm loss") < out.index("mtp_1 loss") < out.index("mtp_2 loss")
    assert [json.loads(line)["mtp_2 loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [4.0, 6.0]
    assert ("mtp_1 loss", 5.0) in scalars


def test_checkpoint_formats_without_mtp_refuse_it_in_one_line():
    """The Hugging Face layouts of a GPT do not hold the modules (Megatron's torch_dist and
    per-rank files and DeepseekV3ForCausalLM do: tests/test_megatron_mla_checkpoint.py,
    tests/test_hf_deepseek.py): refused by name."""
    from dtgpt.checkpoint.export import hf_layout_for

    cfg = ModelConfig(mtp_num_layers=1)
    with pytest.raises(ValueError, match="model.mtp_num_layers") as err:
        hf_layout_for(cfg)
    assert "\n" not in str(err.value)
