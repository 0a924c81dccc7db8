"""Blends: the data_path grammar, the greedy blending index, per-split paths, the stable order.

Megatron's blends themselves are checked against megatron-core in test_data_megatron_oracle.py."""

import numpy as np
import pytest

from dtgpt.config import ConfigError
from dtgpt.config.blend import parse_blend
from dtgpt.data.blended import BlendedDataset, build_blending_indices
from dtgpt.data.builder import build_gpt_datasets, component_size
from dtgpt.data.indexed import DataError, IndexedDatasetWriter

SEQ = 16


def make_prefix(path, low, high, docs=40, seed=0):
    """Documents whose tokens all lie in [low, high): tells which dataset a sample came from."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, np.uint16) as w:
        for _ in range(docs):
            w.add_document(rng.integers(low, high, rng.integers(5, 60)))
    return str(path)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    return make_prefix(d / "a", 0, 500, seed=1), make_prefix(d / "b", 500, 1000, seed=2), str(d / "cache")


def test_parse_blend():
    assert parse_blend(["a"]) == (["a"], None)
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["3 a 1 b"]) == (["a", "b"], [3.0, 1.0])
    assert parse_blend(["1", "a", "0", "b"]) == (["a"], [1.0])
    for bad in (["0.3", "a", "b"], ["a", "0.3"], ["0.5", "a", "-1", "b"], []):
        with pytest.raises(ConfigError, match="data.data_path"):
            parse_blend(bad)


def test_blending_index_by_hand():
    # Megatron: target w * max(n, 1) minus the count so far, the largest wins; ties go to the lower index
    # n=0: .2, .8 -> 1;  n=1: .2, -.2 -> 0;  n=2: -.6, .6 -> 1;  n=3: -.4, .4 -> 1;  n=4: -.2, .2 -> 1;
    # n=5: 0, 0 (tie) -> 0
    assert build_blending_indices([0.2, 0.8], 6)[0].tolist() == [1, 0, 1, 1, 1, 0]
    # stable: target w * (n + 1): n=0: .2, .8 -> 1;  n=1: .4, .6 -> 1;  n=2: .6, .4 -> 0;  n=3: -.2, 1.2 -> 1;
    # n=4: 0, 1 -> 1;  n=5: .2, .8 -> 1
    assert build_blending_indices([0.2, 0.8], 6, "stable")[0].tolist() == [1, 1, 0, 1, 1, 1]
    assert build_blending_indices([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]
    ds, sample = build_blending_indices([1.0], 3)
    assert ds.tolist() == [0, 0, 0] and sample.tolist() == [0, 1, 2]


@pytest.mark.parametrize("order,slack", [("megatron", 2.0), ("stable", 1.0)])
@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.1, 0.2, 0.3, 0.4], [0.05, 0.9, 0.05]])
def test_blend_proportions(weights, order, slack):
    """Every dataset stays within `slack` samples of its share (Megatron's rule trails by up to ~1.3)."""
    size = 5000
    dataset_index, sample_index = build_blending_indices(weights, size, order)
    onehot = np.eye(len(weights), dtype=np.int64)[dataset_index]
    counts = np.cumsum(onehot, axis=0)  # counts[n - 1] = realised picks after n samples
    target = np.outer(np.arange(1, size + 1), weights)
    assert np.abs(counts - target).max() <= slack
    for d in range(len(weights)):  # each dataset is read in order, 0, 1, 2, ...
        assert sample_index[dataset_index == d].tolist() == list(range(counts[-1, d]))


def test_blended_split_datasets(prefixes):
    a, b, cache = prefixes
    n = (300, 20, 0)
    train, valid, test = build_gpt_datasets(["0.3", a, "0.7", b], "90,10,0", ([], [], []), n, SEQ, 5, cache)
    assert isinstance(train, BlendedDataset) and len(train) == 90 + 210 and len(valid) == 6 + 14 and test is None
    from_b = np.array([train[i].min() >= 500 for i in range(len(train))])
    assert abs(from_b.sum() - 0.7 * 300) <= 1
    assert all(train[i].shape == (SEQ + 1,) and train[i].dtype == np.int64 for i in range(0, 300, 37))
    assert len(train.datasets[0]) >= component_size(300, 0.3) == 91
    # the valid split reads only the documents after the train split's boundary (36 of 40)
    for part in valid.datasets:
        lo, hi = part.description["documents"]
        assert (lo, hi) == (36, 40)
    # rebuilt from the cache: identical samples
    again = build_gpt_datasets(["0.3", a, "0.7", b], "90,10,0", ([], [], []), n, SEQ, 5, cache)[0]
    assert all(np.array_equal(train[i], again[i]) for i in range(300))


def test_single_prefix_is_blended_only_with_a_weight(prefixes):
    a, _, cache = prefixes
    train, valid, test = build_gpt_datasets([a], "1", ([], [], []), (50, 10, 10), SEQ, 5, cache)
    assert type(train).__name__ == "GPTDataset" and valid is None and test is None
    weighted = build_gpt_datasets(["1", a], "1", ([], [], []), (50, 0, 0), SEQ, 5, cache)[0]
    assert type(weighted).__name__ == "BlendedDataset" and len(weighted.datasets[0]) >= component_size(50, 1.0)
    stable = build_gpt_datasets(["1", a], "1", ([], [], []), (50, 0, 0), SEQ, 5, cache, order="stable")[0]
    assert type(stable).__name__ == "GPTDataset"


def test_per_split_paths(prefixes):
    a, b, cache = prefixes
    train, valid, test = build_gpt_datasets([], "969,30,1", ([a], [b], []), (40, 10, 5), SEQ, 5, cache)
    assert all(train[i].max() < 500 for i in range(len(train)))
    assert all(valid[i].min() >= 500 for i in range(len(valid)))
    assert test is None
    assert train.description["documents"] == [0, 40]  # whole datasets, no split
    with pytest.raises(ValueError, match="not both"):
        build_gpt_datasets([a], "1", ([a], [], []), (4, 0, 0), SEQ, 5, cache)


def test_a_blend_component_without_documents_in_a_split(prefixes, tmp_path, capsys):
    """With "90,5,5", 10 documents leave a small corpus's test split [10, 10): that component is
    left out of the test blend (the other makes it, and a note says so), and a validation or test
    split with no component left is None after a note. Such a train split is an error."""
    a, b, cache = prefixes
    small = make_prefix(tmp_path / "small", 0, 500, docs=10, seed=3)
    train, valid, test = build_gpt_datasets(["0.5", small, "0.5", b], "90,5,5", ([], [], []), (40, 8, 8), SEQ, 5, cache)
    assert all(test[i].min() >= 500 for i in range(len(test)))  # every test sample is b's
    assert any(valid[i].max() < 500 for i in range(len(valid)))  # small still holds a validation document
    assert capsys.readouterr().out.splitlines() == [
        f'> note: the test split of data.split="90,5,5" gets nothing from {small} (no documents of 10): the test blend is built '
        "from the other 1 of 2"
    ]
    assert build_gpt_datasets([small], "90,5,5", ([], [], []), (40, 8, 8), SEQ, 5, cache)[2] is None
    assert capsys.readouterr().out.strip() == '> note: the test split of data.split="90,5,5" has no documents of 10: no test evaluation'
    with pytest.raises(DataError, match=r'the train split of data.split="1,99,0" has no documents of 10: nothing to train on'):
        build_gpt_datasets([small], "1,99,0", ([], [], []), (40, 8, 0), SEQ, 5, cache)


def test_missing_prefix_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothere\.idx: no such file"):
        build_gpt_datasets([str(tmp_path / "nothere")], "1", ([], [], []), (4, 0, 0), SEQ, 5, str(tmp_path))


def test_stable_blend_order_does_not_depend_on_the_number_of_samples(prefixes):
    """Invariant 2 for blends, opt-in: a longer run (several epochs of each component) starts with
    exactly the samples of a shorter one, so train_iters may change on resume."""
    a, b, cache = prefixes
    short, long = (build_gpt_datasets(["0.3", a, "0.7", b], "90,10,0", ([], [], []), (n, 0, 0), SEQ, 5, cache,
                                      order="stable")[0]
                   for n in (100, 900))
    assert long.datasets[1].num_epochs > short.datasets[1].num_epochs
    assert all(np.array_equal(short[i], long[i]) for i in range(len(short)))


def test_stable_unweighted_blend_weighs_prefixes_equally(prefixes):
    a, b, cache = prefixes
    train = build_gpt_datasets([a, b], "1", ([], [], []), (400, 0, 0), SEQ, 5, cache, order="stable")[0]
    assert len(train) == 400 and np.bincount(train.dataset_index).tolist() == [200, 200]


def test_per_split_paths_without_a_valid_path_train_only_without_evaluation(prefixes, capfd):
    """Megatron's --train-data-path without --valid-data-path builds no validation set, and then fails
    at its first evaluation (eval_iters > 0): dtgpt refuses that in one line before the run; with
    --eval-iters 0 Megatron trains, and so does dtgpt (no validation split, no test one without its path)."""
    from dtgpt.api import num_samples_needed
    from dtgpt.cli import run_main
    from dtgpt.config import load_config
    from dtgpt.data import build_datasets, build_tokenizer

    a, b, cache = prefixes
    flags = ["--train-data-path", a, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-cache-path", cache,
             "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
             "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3"]  # fmt: skip
    for eval_flags in ([], ["--eval-iters", "2", "--test-data-path", b]):
        assert run_main([*flags, *eval_flags, "--dry-run"], None, None) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("error: --valid-data-path is unset beside --train-data-path, so there is no validation data "
                              f"for --eval-iters {eval_flags[1] if eval_flags else 10}: set --valid-data-path, or --eval-iters 0")  # fmt: skip
    cfg = load_config(None, [*flags, "--eval-iters", "0"])
    train, valid, test = build_datasets(cfg, build_tokenizer(cfg.data), num_samples_needed(cfg))
    assert len(train) >= 6 and valid is None and test is None
