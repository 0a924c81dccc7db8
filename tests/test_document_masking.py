"""Document masking and position reset in the model, and the loss over unmasked tokens only."""

import pytest
import torch
import torch.nn.functional as F

from dtgpt.config import Config, ModelConfig
from dtgpt.data.batch import IGNORE_INDEX, TokenOptions, build_batch
from dtgpt.model import GPT
from dtgpt.parallel import ParallelDims, build_model_parts
from dtgpt.step import local_forward_backward

EOD, VOCAB, T = 63, 64, 24
ALL_ON = TokenOptions(EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)


def tiny_model(rope: bool) -> GPT:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=T, hidden_dropout=0.0,
                      attention_dropout=0.0, position_embedding_type="rope" if rope else "learned_absolute")
    model = GPT(cfg, VOCAB)
    model.init_weights(seed=3)
    return model


def samples(batch: int = 2) -> torch.Tensor:
    """(batch, T + 1) tokens with eods at 6 and 15 in the first row, 10 in the second."""
    x = torch.randint(0, EOD, (batch, T + 1), generator=torch.Generator().manual_seed(0))
    x[0, [6, 15]] = EOD
    x[1, 10] = EOD
    return x


def test_batch_fields_on_a_small_sample():
    x = torch.tensor([[5, EOD, 7, 8, EOD, 9, 4]])
    b = build_batch(x, ALL_ON)
    assert b.tokens.tolist() == [[5, EOD, 7, 8, EOD, 9]]
    assert b.labels.tolist() == [[EOD, IGNORE_INDEX, 8, EOD, IGNORE_INDEX, 4]]  # no loss where the input is eod
    assert b.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]  # the eod ends its document
    assert b.document_ids.tolist() == [[0, 0, 1, 1, 1, 2]]
    plain = build_batch(x)
    assert plain.position_ids is None and plain.document_ids is None and plain.labels.tolist() == [[EOD, 7, 8, EOD, 9, 4]]


@pytest.mark.parametrize("rope", [False, True])
def test_no_token_attends_across_a_document_boundary(rope):
    model = tiny_model(rope)
    batch = build_batch(samples(), ALL_ON)
    embedded = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        embedded["h"] = output

    model.embedding.register_forward_hook(keep)

    def gradient_of_output(row: int, t: int, masked: bool) -> torch.Tensor:
        model.zero_grad()
        kwargs = batch.model_inputs() if masked else {}
        logits = model(batch.tokens, **kwargs)
        logits[row, t].square().sum().backward()
        return embedded["h"].grad[row].abs().sum(dim=-1)  # (T,): how much each input token moved it

    # Token 20 of row 0 is in the third document (after the eods at 6 and 15).
    g = gradient_of_output(0, 20, masked=True)
    assert torch.all(g[:16] == 0), g  # exactly zero: earlier documents, their eods included
    assert torch.all(g[16:21] > 0) and torch.all(g[21:] == 0)  # its own document up to itself
    g = gradient_of_output(1, 12, masked=True)
    assert torch.all(g[:11] == 0) and torch.all(g[11:13] > 0)
    # Without document ids the same token does see the earlier documents: the mask is what cuts them.
    assert torch.all(gradient_of_output(0, 20, masked=False)[:21] > 0)


def test_a_reset_document_computes_as_if_it_started_the_sequence():
    """With both resets, the third document's logits do not depend on what came before it."""
    for rope in (False, True):
        model = tiny_model(rope)
        x = samples()
        alone = x[:1, 16:]  # the third document of row 0 as a sample of its own
        packed_logits = model(**_inputs(build_batch(x, ALL_ON)))[0, 16:]
        alone_logits = model(**_inputs(build_batch(alone, ALL_ON)))[0]
        torch.testing.assert_close(packed_logits, alone_logits, rtol=1e-5, atol=1e-5)


def _inputs(batch):
    return {"x": batch.tokens, **batch.model_inputs()}


def test_loss_is_the_mean_over_unmasked_tokens_whatever_the_micro_batches():
    """forward_backward's normaliser counts the labels eod_mask_loss leaves, over the global batch:
    4 micro-batches give the loss of one, which is the mean over unmasked tokens only."""
    cfg = Config()
    cfg.model = tiny_model(rope=False).cfg
    cfg.data.mock_data = True
    batch = build_batch(samples(4), ALL_ON)
    kept = batch.labels != IGNORE_INDEX
    assert (~kept).sum() == 3  # the eods of rows 0 and 1
    losses = []
    for n_micro in (1, 4):
        with torch.device("meta"):
            whole = GPT(cfg.model, VOCAB)
        model = build_model_parts(cfg, ParallelDims.from_config(cfg, 1), whole, torch.device("cpu"))
        losses.append(local_forward_backward(model, batch, n_micro, forward_only=True))
    with torch.no_grad():
        logits = model.parts[0](batch.tokens, **batch.model_inputs())
    mean_unmasked = F.cross_entropy(logits.flatten(0, 1)[kept.flatten()], batch.labels[kept])
    assert losses[0].item() == pytest.approx(mean_unmasked.item(), rel=1e-6)
    assert losses[1].item() == pytest.approx(mean_unmasked.item(), rel=1e-6)


def test_evaluation_is_tokens_over_tokens_across_batches():
    """evaluate() sums every token loss of its batches over all their loss tokens, as Megatron's
    evaluate does: two global batches with very different loss-token counts under eod_mask_loss
    (half the tokens of one are eods) give the direct computation, not the mean of the two means."""
    from dtgpt.step import evaluate

    cfg = Config()
    cfg.model = tiny_model(rope=False).cfg
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 2, 4
    crowded = samples(4)
    crowded[:, ::2] = EOD  # every other input is an eod: its label is not a loss token
    batches = [build_batch(crowded, ALL_ON), build_batch(samples(4), ALL_ON)]
    with torch.device("meta"):
        whole = GPT(cfg.model, VOCAB)
    model = build_model_parts(cfg, ParallelDims.from_config(cfg, 1), whole, torch.device("cpu"))
    loss = evaluate(cfg, model, iter(batches), 2)

    sums, counts = [], []
    with torch.no_grad():
        for b in batches:
            logits = model.parts[0](b.tokens, **b.model_inputs())
            kept = b.labels != IGNORE_INDEX
            sums.append(F.cross_entropy(logits[kept], b.labels[kept], reduction="sum").item())
            counts.append(kept.sum().item())
    assert counts[0] < 0.6 * counts[1]
    assert loss == pytest.approx(sum(sums) / sum(counts), rel=1e-6)
    mean_of_means = (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    assert abs(loss - mean_of_means) > 1e-3 * loss
