"""scripts/preprocess_data.py takes every flag of Megatron-LM's tools/preprocess_data.py: each one
(the list stored in dtgpt/data/preprocess_flags.py) is read with Megatron's meaning, accepted
with one note where it changes nothing, or refused in one line where its meaning is not built,
before anything is written."""

from __future__ import annotations

import json

import pytest

from dtgpt.data.indexed import IndexedDataset
from dtgpt.data.preprocess_flags import NOTED, REFUSED, TAKEN, preprocess_flags
from tests.runs import load_script

VALUES = {"tokenizer-type": "ByteTokenizer", "workers": "1", "vocab-size": "10", "json-keys": "text", "log-interval": "1000",
          "partitions": "1", "max-documents": "10", "tiktoken-num-special-tokens": "1000", "vocab-extra-ids": "0", "tiktoken-pattern": "v2",
          "padded-vocab-size": "512", "workers-to-check": "2"}  # fmt: skip


def argv_of(name: str) -> list[str]:
    flag = preprocess_flags()[name]
    return [f"--{name}"] if flag.arity == "0" else [f"--{name}", VALUES.get(name, "x")]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("one document", "and another")))
    return path


def test_every_megatron_preprocess_flag_has_a_meaning_here():
    flags = preprocess_flags()
    assert len(flags) == 32 and list(flags)[:2] == ["input", "json-keys"] and "trust-remote-code" in flags
    assert sorted(flags) == sorted([*TAKEN, *NOTED, *REFUSED])
    assert not set(TAKEN) & set(NOTED) and not set(NOTED) & set(REFUSED)


@pytest.mark.slow  # 32 runs of the script (~10 s): make test runs them
@pytest.mark.parametrize("name", list(preprocess_flags()))
def test_each_flag_is_taken_noted_or_refused(tmp_path, corpus, capfd, name):
    script = load_script("preprocess_data")
    base = {"--input": str(corpus), "--output-prefix": str(tmp_path / "out"), "--tokenizer-type": "ByteTokenizer"}
    given = argv_of(name)
    argv = [a for k, v in base.items() if k != given[0] for a in (k, v)] + (
        [given[0], base[given[0]]] if given[0] in base else given
    )
    if name in ("vocab-file", "merge-file", "tokenizer-model", "vocab-size", "tokenizer-hf-include-special-tokens",
                "tokenizer-special-tokens", "tiktoken-special-tokens"):  # fmt: skip
        assert vars(script.parse_args(argv))[name.replace("-", "_")] not in (None, "", 0, False)  # read, with its meaning
        return  # (each tokenizer's files are tested end to end in tests/test_data_preprocess.py)
    code = script.main(argv)
    out, err = capfd.readouterr()
    if name in REFUSED:
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: --{name} "), err
        assert not list(tmp_path.glob("out*"))
        return
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == ([f"note: --{name} changes nothing here: {NOTED[name]}"] if name in NOTED else []), err
    assert IndexedDataset(tmp_path / "out_text_document").num_documents == 2


def test_a_repeated_json_key_is_refused(tmp_path, corpus, capfd):
    code = load_script("preprocess_data").main(["--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                                                "--tokenizer-type", "ByteTokenizer", "--json-keys", "text", "text"])  # fmt: skip
    assert code == 2 and capfd.readouterr().err == "error: --json-keys names 'text' twice: each key writes one dataset (['text', 'text'])\n"
    assert not list(tmp_path.glob("out*"))
