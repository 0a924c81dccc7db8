"""data.order = "megatron": sample i of every split is megatron-core's sample i.

Each case builds the same indexed datasets through dtgpt and through megatron-core's
BlendedMegatronDatasetBuilder (the dev extra's: 0.19.2, or 0.16.1 below Python 3.12) and
compares the first 5,000 samples of each split token for token (all of them when a split holds
fewer). With split 969,30,1 over 1,000 documents the valid split needs ~90 epochs and the test
split (one document) thousands, so every case is multi-epoch there; the train split is run on
both sides of Megatron's 80 % separate-final-epoch rule.
"""

import numpy as np
import pytest

from dtgpt.config.split import SPLIT_NAMES, parse_split, split_document_ranges
from dtgpt.data.builder import build_gpt_datasets
from dtgpt.data.gpt_dataset import GPTDataset
from dtgpt.data.gpt_indices import num_epochs_needed, separate_final_epoch
from dtgpt.data.indexed import IndexedDataset
from tests.megatron_oracle import megatron_datasets, megatron_sample, write_documents

SEQ, SEED, SPLIT, FIRST, DOCUMENTS = 16, 1234, "969,30,1", 5000, 1000


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle")
    return [write_documents(str(d / name), DOCUMENTS, seed) for seed, name in enumerate("abc")]


def train_tokens(prefix: str) -> int:
    lo, hi = split_document_ranges(SPLIT, DOCUMENTS)[0]
    return int(IndexedDataset(prefix).sequence_lengths[lo:hi].sum())


def assert_same_samples(ours, theirs) -> None:
    for name, o, m in zip(SPLIT_NAMES, ours, theirs):
        assert (o is None) == (m is None), name
        if o is None:
            continue
        assert type(o).__name__ == type(m).__name__ and len(o) == len(m), name
        n = min(len(o), FIRST)
        differ = [i for i in range(n) if not np.array_equal(o[i], megatron_sample(m, i))]
        assert not differ, f"{name}: {len(differ)} of {n} samples differ from Megatron's, the first at {differ[0]}"


def compare(tmp_path, sizes, split=SPLIT, **paths):
    ours = build_gpt_datasets(paths.get("data_path", []), split, paths.get("per_split_paths", ([], [], [])),
                              sizes, SEQ, SEED, str(tmp_path / "dtgpt"))
    theirs = megatron_datasets(str(tmp_path), sizes, SEQ, SEED, split=split if "data_path" in paths else None, **paths)
    assert_same_samples(ours, theirs)
    return ours, theirs


@pytest.mark.parametrize("final_epoch", ["one epoch", "kept apart", "shuffled in"])
def test_single_dataset(tmp_path, prefixes, final_epoch):
    a = prefixes[0]
    tokens = train_tokens(a)
    per_epoch = (tokens - 1) // SEQ
    # one epoch; four epochs whose last is used 50 % (< 80 %: apart) or 90 % (shuffled with the rest)
    n = {"one epoch": per_epoch // 2, "kept apart": 3 * per_epoch + per_epoch // 2,
         "shuffled in": 3 * per_epoch + 9 * per_epoch // 10}[final_epoch]
    epochs = num_epochs_needed(tokens, n, SEQ)
    assert epochs == (1 if final_epoch == "one epoch" else 4) and (n >= FIRST or epochs == 1)
    assert separate_final_epoch(tokens, epochs, n, SEQ) == (final_epoch == "kept apart")
    ours, theirs = compare(tmp_path, (n, FIRST, FIRST), data_path=[a])
    for o, m in zip(ours, theirs):  # the index arrays themselves, dtypes included
        assert isinstance(o, GPTDataset)
        for name in ("document_index", "sample_index", "shuffle_index"):
            np.testing.assert_array_equal(getattr(o, name), getattr(m, name))
            assert getattr(o, name).dtype == getattr(m, name).dtype, name


def test_two_way_weighted_blend(tmp_path, prefixes):
    a, b, _ = prefixes
    ours, _ = compare(tmp_path, (FIRST, FIRST, FIRST), data_path=["0.3", a, "0.7", b])
    assert ours[0].datasets[1].num_epochs > 1  # the components need several epochs too


def test_three_way_weighted_blend_with_unnormalised_weights(tmp_path, prefixes):
    a, b, c = prefixes
    compare(tmp_path, (FIRST + 7, FIRST, FIRST), data_path=["20", a, "50", b, "30", c])


def test_unweighted_blend_is_size_weighted_and_capped(tmp_path, prefixes):
    a, b, _ = prefixes
    ours, _ = compare(tmp_path, (FIRST, FIRST, FIRST), data_path=[a, b])
    # one epoch of each component: fewer samples than asked for, as in Megatron
    assert len(ours[0]) == len(ours[0].datasets[0]) + len(ours[0].datasets[1]) < FIRST


def test_per_split_blends(tmp_path, prefixes):
    a, b, c = prefixes
    per_split = (["0.6", a, "0.4", b], ["1", c], [a, b, c])
    compare(tmp_path, (FIRST, FIRST, 800), per_split_paths=per_split)


@pytest.mark.parametrize("split", ["100,0,0", "99,1,0"])
def test_a_split_of_weight_0_has_no_dataset_as_in_megatron(tmp_path, prefixes, split):
    """A split of weight 0 in data.split, of one prefix or of a blend, and a per-split path left
    unset: no dataset on either side (the rest sample for sample). With eval.eval_iters > 0 Megatron
    then fails at its first evaluation, so dtgpt refuses a validation split of weight 0 before the
    run and notes a missing test split (tests/test_config_evaluation_data.py)."""
    a, b, _ = prefixes
    sizes = (500, 200, 200)
    for data_path in ([a], ["0.3", a, "0.7", b]):
        ours, _ = compare(tmp_path, sizes, split, data_path=data_path)
        assert [d is None for d in ours] == [w == 0 for w in parse_split(split)]
    ours, _ = compare(tmp_path, sizes, per_split_paths=([a], ["1", b] if split == "99,1,0" else [], []))
    assert [d is None for d in ours] == [False, split == "100,0,0", True]


def test_sample_index_is_megatrons_helper():
    """build_sample_index against megatron-core's C++ build_sample_idx on random small streams:
    empty documents anywhere (first ones included), several epochs, powers of two and others."""
    from megatron.core.datasets.helpers import build_sample_idx

    from dtgpt.data.gpt_indices import build_sample_index

    rng = np.random.default_rng(5)
    for _ in range(300):
        documents = int(rng.integers(1, 50))
        sizes = rng.integers(0, 40, documents).astype(np.int32)
        sizes[rng.integers(0, documents)] += 1
        epochs, seq = int(rng.integers(1, 4)), int(rng.choice([2, 3, 7, 16, 31, 32, 64, 69]))
        document_index = np.tile(np.arange(documents, dtype=np.int32), epochs)
        rng.shuffle(document_index)
        tokens = int(sizes.sum())
        if (epochs * tokens - 1) // seq < 1:
            continue
        ours = build_sample_index(sizes, document_index, seq)
        theirs = build_sample_idx(sizes, document_index, seq, epochs, tokens)
        np.testing.assert_array_equal(ours, theirs)
        assert ours.dtype == theirs.dtype
