"""preprocess_data.py end to end, and the preprocess() function it wraps."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtgpt.config import DataConfig
from dtgpt.data.indexed import IndexedDataset
from dtgpt.data.preprocess import PreprocessError, preprocess

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "preprocess_data.py"
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def integer_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 999, rng.integers(1, 30)).tolist() for _ in range(n)]


def test_null_tokenizer_end_to_end(tmp_path):
    docs = integer_docs(40)
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": " ".join(map(str, d))}) for d in docs])
    r = run_script("--input", src, "--output-prefix", tmp_path / "out", *NULL, "--append-eod")
    assert r.returncode == 0, r.stderr
    assert "40 documents" in r.stdout and "tokens/s" in r.stdout and "MB/s" in r.stdout
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.dtype == np.uint16 and len(ds) == 40 and ds.num_documents == 40
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d + [1000]  # Megatron's NullTokenizer: eod = vocab_size


def test_workers_preserve_order(tmp_path):
    docs = integer_docs(300, seed=1)
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": " ".join(map(str, d))}) for d in docs])
    cfg = DataConfig(tokenizer_type="NullTokenizer", vocab_size=1000)
    log = io.StringIO()
    # tiny chunks so the two workers interleave many chunks that must come back in order
    preprocess(str(src), str(tmp_path / "two"), cfg, workers=2, chunk_bytes=200, log=log)
    preprocess(str(src), str(tmp_path / "one"), cfg, workers=1, log=log)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"two_text_document{ext}").read_bytes() == (tmp_path / f"one_text_document{ext}").read_bytes()
    ds = IndexedDataset(tmp_path / "two_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == docs


def test_bad_lines_reported_and_skipped(tmp_path):
    lines = [
        json.dumps({"text": "1 2 3"}),
        "{not json",
        json.dumps({"body": "4 5"}),
        json.dumps({"text": 45}),
        "",
        json.dumps({"text": "6 7"}),
        json.dumps(["text", "8"]),
        json.dumps({"text": "5 1000"}),
        json.dumps({"text": "8 9"}),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    r = run_script("--input", src, "--output-prefix", tmp_path / "out", *NULL)
    assert r.returncode == 0, r.stderr
    err = r.stderr
    assert f"{src}:2: invalid JSON" in err
    assert f"{src}:3: missing key 'text'" in err
    assert f"{src}:4: key 'text' holds a int, not a string" in err
    assert f"{src}:7: not a JSON object but a list" in err
    assert f"{src}:8: NullTokenizer: ids [1000] are outside [0, 1000)" in err
    assert ":5:" not in err and ":1:" not in err  # the blank line is not an error
    assert "5 bad lines skipped" in r.stdout
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [6, 7], [8, 9]]


def test_strict_refuses_the_file(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "1 2"}), "{oops", json.dumps({"text": "3"})])
    r = run_script("--input", src, "--output-prefix", tmp_path / "out", *NULL, "--strict")
    assert r.returncode != 0
    assert f"{src}:2: invalid JSON" in r.stderr and "strict" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written, no temporaries


def test_strict_with_workers_stops_cleanly(tmp_path):
    lines = [json.dumps({"text": "1 2"})] * 200 + ["{oops"] + [json.dumps({"text": "3"})] * 200
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(PreprocessError, match=r"in\.jsonl:201: invalid JSON"):
        preprocess(str(src), str(tmp_path / "out"), DataConfig(tokenizer_type="NullTokenizer", vocab_size=10),
                   workers=2, strict=True, chunk_bytes=100, log=io.StringIO())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_several_keys_and_byte_tokenizer(tmp_path):
    rows = [{"text": "héllo", "title": "a"}, {"text": "", "title": "bc"}]
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in rows])
    stats = preprocess(str(src), str(tmp_path / "out"), DataConfig(tokenizer_type="ByteTokenizer"),
                       json_keys=("text", "title"), append_eod=True, log=io.StringIO())
    assert stats.documents == 2 and stats.tokens == (6 + 1) + 0 + 2 + 3
    text = IndexedDataset(tmp_path / "out_text_document")
    title = IndexedDataset(tmp_path / "out_title_document")
    # the empty text is a document without sequences and without eod, as in Megatron
    assert text.num_documents == 2 and len(text) == 1 and text[0].tolist() == list("héllo".encode()) + [256]
    assert [title[i].tolist() for i in range(2)] == [[97, 256], [98, 99, 256]]


def test_missing_input(tmp_path):
    r = run_script("--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "o", *NULL)
    assert r.returncode == 2 and "nope.jsonl: no such input file" in r.stderr


@pytest.mark.parametrize("append_eod", [True, False])
def test_empty_texts_as_megatron_writes_them(tmp_path, append_eod):
    """Megatron's preprocess_data.py (not in the pip package, so its rule is restated here):
    tokenize, append eod only to a document with tokens, add the document even when it has no
    sequence. megatron-core's own IndexedDatasetBuilder writes the expected files."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(3)
    docs = [[] if i % 5 == 2 else rng.integers(0, 1000, rng.integers(1, 20)).tolist() for i in range(60)]
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": " ".join(map(str, d))}) for d in docs])
    stats = preprocess(str(src), str(tmp_path / "ours"), DataConfig(tokenizer_type="NullTokenizer", vocab_size=1000),
                       append_eod=append_eod, log=io.StringIO())
    assert stats.documents == 60 and stats.empty_documents == 12
    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), dtype=np.uint16)
    for d in docs:
        ids = d + [1000] if d and append_eod else d
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)] if ids else [])
    builder.finalize(str(tmp_path / "megatron.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours_text_document{ext}").read_bytes() == (tmp_path / f"megatron{ext}").read_bytes()


def test_hugging_face_tokenizer(tmp_path):
    """Megatron's `--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`: each document is
    the tokenizer's ids then its eos (a BOS first only with --tokenizer-hf-include-special-tokens);
    a directory without an eos token is one error line and writes nothing."""
    from dtgpt.data.tokenizer import HuggingFaceTokenizer
    from tests.test_data_tokenizer import TEXTS, write_hf_tokenizer

    directory = write_hf_tokenizer(tmp_path / "tok")
    texts = [f"{i}: {t}" for i, t in enumerate(TEXTS)]
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in texts])
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory, "--append-eod"]
    for include in (False, True):
        flags = ["--tokenizer-hf-include-special-tokens"] if include else []
        r = run_script("--input", src, "--output-prefix", tmp_path / f"out{include}", *hf, *flags, "--workers", "2")
        assert r.returncode == 0, r.stderr
        tok = HuggingFaceTokenizer(str(directory), include_special_tokens=include)
        ds = IndexedDataset(tmp_path / f"out{include}_text_document")
        assert ds.dtype == np.uint16 and len(ds) == len(texts)
        assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) + [tok.eod] for t in texts]
        assert bool(ds[0][0] == 0) is include  # <s>, the BOS, is id 0
    no_eos = write_hf_tokenizer(tmp_path / "no_eos", config=None)
    r = run_script("--input", src, "--output-prefix", tmp_path / "bad", *hf[:2], "--tokenizer-model", no_eos)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: data.tokenizer_model=") and "no eos_token in tokenizer_config.json" in r.stderr
    assert not list(tmp_path.glob("bad*"))
