"""Megatron's per-token options and mock data, against megatron-core's GPTDataset
(0.19.2; 0.16.1 below Python 3.12).

For three sequence lengths and eod_mask_loss, reset_position_ids and reset_attention_mask each
off and on (all off, each alone, all on), the first 1,000 samples' loss mask, position ids and attention mask
equal those megatron-core's GPTDataset returns (create_attention_mask on). dtgpt's loss mask is
its labels: IGNORE_INDEX where Megatron's loss_mask is 0. Mock samples equal MockGPTDataset's.
"""

import numpy as np
import pytest
import torch

from dtgpt.config.split import SPLIT_NAMES
from dtgpt.data.batch import IGNORE_INDEX, Batch, TokenOptions, build_batch
from dtgpt.data.builder import build_gpt_datasets
from dtgpt.data.mock import build_mock_dataset
from dtgpt.model import allowed_keys
from tests.megatron_oracle import VOCAB, megatron_datasets, megatron_mock_datasets, megatron_sample, write_documents

SEED, SPLIT, FIRST = 1234, "969,30,1", 1000
EOD = VOCAB  # megatron_null_tokenizer() puts the eod after the ids
SWITCHES = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")
# Every switch off and on: all off, each alone, all together (the resets share Megatron's eod loop).
COMBINATIONS = [(False, False, False), (True, False, False), (False, True, False), (False, False, True), (True, True, True)]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    """Documents ending in eod, as preprocessing with append_eod writes them (eod often mid-sample)."""
    return write_documents(str(tmp_path_factory.mktemp("tokens") / "docs"), 400, seed=7, eod=EOD)


def assert_same_fields(batch: Batch, i: int, item: dict, where: str) -> None:
    """Sample i of dtgpt's batch against Megatron's item for the same sample."""
    assert torch.equal(batch.tokens[i], item["tokens"]), f"{where}: tokens"
    assert torch.equal((batch.labels[i] != IGNORE_INDEX).float(), item["loss_mask"]), f"{where}: loss_mask"
    T = batch.tokens.shape[1]
    positions = batch.position_ids[i] if batch.position_ids is not None else torch.arange(T)
    assert torch.equal(positions, item["position_ids"]), f"{where}: position_ids"
    index = torch.arange(T)
    if batch.document_ids is None:
        allowed = allowed_keys(index, index).unsqueeze(0)  # (1, T, T), as Megatron's
    else:
        documents = batch.document_ids[i : i + 1]
        allowed = allowed_keys(index, index, documents, documents)[0]
    assert torch.equal(~allowed, item["attention_mask"]), f"{where}: attention_mask"  # Megatron's True: masked


@pytest.mark.slow
@pytest.mark.parametrize("seq_length", [16, 61, 128])
def test_per_token_fields_are_megatrons(tmp_path, prefix, seq_length):
    ours = build_gpt_datasets([prefix], "1", ([], [], []), (FIRST, 0, 0), seq_length, SEED, str(tmp_path / "dtgpt"))[0]
    samples = torch.from_numpy(np.stack([ours[i] for i in range(FIRST)]))
    assert (samples[:, :-1] == EOD).any(dim=1).float().mean() > 0.3  # the switches have eods to act on
    for on in COMBINATIONS:
        switches = dict(zip(SWITCHES, on))
        theirs = megatron_datasets(str(tmp_path), (FIRST, 0, 0), seq_length, SEED, data_path=[prefix],
                                   split="1", create_attention_mask=True, **switches)[0]
        batch = build_batch(samples, TokenOptions(EOD, **switches))
        for i in range(FIRST):
            assert_same_fields(batch, i, theirs[i], f"seq {seq_length} {switches} sample {i}")


@pytest.mark.parametrize("seq_length", [32, 1000])
def test_mock_data_is_megatrons_mock_gpt_dataset(tmp_path, seq_length):
    sizes = (FIRST, 50, 10)
    theirs = megatron_mock_datasets(str(tmp_path), sizes, seq_length, SEED, SPLIT)  # Megatron ignores SPLIT
    for s, (name, n) in enumerate(zip(SPLIT_NAMES, sizes)):
        ours = build_mock_dataset(s, n, seq_length, VOCAB + 1, EOD, SEED, name, str(tmp_path / "dtgpt"))
        assert len(ours) == len(theirs[s]), name
        differ = [i for i in range(n) if not np.array_equal(ours[i], megatron_sample(theirs[s], i))]
        assert not differ, f"{name}: {len(differ)} of {n} mock samples differ from Megatron's, the first at {differ[0]}"
