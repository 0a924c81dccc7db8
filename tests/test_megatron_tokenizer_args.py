"""A run's tokenizer in Megatron-LM's checkpoint args: `to-megatron` records the tokenizer keys under
Megatron's names, and `checkpoint.use_checkpoint_args` takes back those Megatron's own load takes
(tokenizer type and model unless --no-use-tokenizer-model-from-checkpoint-args, the tiktoken pattern)."""

from __future__ import annotations

import pytest

from dtgpt.checkpoint import megatron
from dtgpt.checkpoint.checkpoint_args import with_checkpoint_architecture
from dtgpt.checkpoint.megatron.reader import MegatronReader
from dtgpt.config import load_config
from tests.test_conversion_bad_input import MODEL, checkpoint, load_script
from tests.tokenizer_files import write_sentencepiece_model, write_tiktoken_vocab

SPECIAL = ["<s>", "</s>", "<unk>", "<mask>", "<pad>", "<cls>", "<sep>", "<extra>"]


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "TikTokenizer"])
def test_to_megatron_records_the_tokenizer_and_use_checkpoint_args_takes_it_back(tmp_path, kind):
    if kind == "TikTokenizer":
        pytest.importorskip("tiktoken")
        path = str(write_tiktoken_vocab(tmp_path / "tt"))
        recorded = {"tiktoken_pattern": "v1", "tiktoken_num_special_tokens": 10, "tokenizer_special_tokens": SPECIAL}
        extra = ("--data.tiktoken_pattern=v1", "--data.tiktoken_num_special_tokens=10", "--data.vocab_size=290",
                 f"--data.tokenizer_special_tokens={SPECIAL}".replace("'", '"'))  # fmt: skip
    else:
        pytest.importorskip("sentencepiece")
        path = str(write_sentencepiece_model(tmp_path / "sp"))
        recorded, extra = {"tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000, "tokenizer_special_tokens": None}, ()
    checkpoint(tmp_path / "ckpt", extra=(f"--data.tokenizer_type={kind}", f"--data.tokenizer_model={path}", *extra))
    meg = tmp_path / "meg"
    assert load_script().main(["to-megatron", str(tmp_path / "ckpt"), str(meg)]) == 0
    args = MegatronReader(megatron.find(str(meg), 0)).common["args"]
    expected = {"tokenizer_type": kind, "tokenizer_model": path, "vocab_file": None, **recorded}
    assert {key: getattr(args, key) for key in expected} == expected

    # a config naming another tokenizer (MODEL's ByteTokenizer) takes the checkpoint's
    resume = [*MODEL, f"--checkpoint.load={meg}", "--use-checkpoint-args"]
    taken, note = with_checkpoint_architecture(load_config(None, resume))
    pattern = recorded["tiktoken_pattern"] or ""
    assert (taken.data.tokenizer_type, taken.data.tokenizer_model, taken.data.tiktoken_pattern) == (kind, path, pattern)
    assert note.endswith(f"'s, and data.tokenizer_type, data.tokenizer_model{', data.tiktoken_pattern' * bool(pattern)} "
                         "(checkpoint.use_checkpoint_args)")  # fmt: skip
    # --no-use-tokenizer-model-from-checkpoint-args keeps the config's type and model; the pattern is taken still
    kept, _ = with_checkpoint_architecture(load_config(None, [*resume, "--no-use-tokenizer-model-from-checkpoint-args"]))
    assert (kept.data.tokenizer_type, kept.data.tokenizer_model, kept.data.tiktoken_pattern) == ("ByteTokenizer", "", pattern)
