"""Megatron's meaning of `--make-vocab-size-divisible-by`, kept where the flag is typed.

Megatron pads the vocabulary to a multiple of `--make-vocab-size-divisible-by` (default 128)
times the tensor-parallel size: its 175B example (tp 8) has 51,200 rows for GPT-2's 50,257
tokens. dtgpt's `model.make_vocab_size_divisible_by` is the multiple itself, so the model never
depends on the mesh it runs on. A Megatron command line has to build Megatron's model (a
checkpoint Megatron writes with the same script must load), so the multiplication by tp happens
once, here, when the config is read: the key then holds the whole multiple (1024 for the 175B
example) and the model is fixed from there on, whatever mesh later loads it.

Two cases take Megatron's meaning:
- `--make-vocab-size-divisible-by N` itself: the key becomes N x tp;
- a command line of Megatron flags without `--config` (a Megatron launch script, which describes
  the whole run with Megatron's defaults) that sets the multiple nowhere: Megatron's default
  128 x tp.
A config file's or a `--model.make_vocab_size_divisible_by` value is dtgpt's: the whole multiple.

`--padded-vocab-size P` gives Megatron's model P vocabulary rows whatever the divisor (which it
then ignores). A tokenizer's vocabulary fits in P (else Megatron's embedding could not look its
tokens up), so the multiple P pads it to P rows exactly: the flag sets the key to P, and a
`--make-vocab-size-divisible-by` beside it is dropped, as Megatron drops it.
"""

from __future__ import annotations

from dtgpt.config.sections import Config

FLAG = "--make-vocab-size-divisible-by"
PADDED_FLAG = "--padded-vocab-size"
KEY = "model.make_vocab_size_divisible_by"
MEGATRON_DEFAULT = 128


def _is_megatron_flag(spelling: str) -> bool:
    """A Megatron flag's spelling (`--num-layers 96`), not a dtgpt override (`--model.x=1`)."""
    return "." not in spelling.split()[0].split("=")[0]


def _flag_of(spelling: str) -> str:
    return spelling.split()[0].split("=")[0]


def padded_vocabulary_wins(overrides: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The translated command line without its divisor flags when --padded-vocab-size is there."""
    if not any(_flag_of(spelling) == PADDED_FLAG for _, _, spelling in overrides):
        return overrides
    return [o for o in overrides if _flag_of(o[2]) != FLAG]


def megatron_launch(spellings: list[str], ignored: list[str], has_file: bool) -> bool:
    """A command line of Megatron flags without `--config`: a launch script, which describes the
    whole run with Megatron's defaults."""
    return not has_file and bool(ignored or any(_is_megatron_flag(s) for s in spellings))


def apply_megatron_vocab_multiple(cfg: Config, spellings: list[str], ignored: list[str], levels: dict, has_file: bool) -> None:
    """Turn Megatron's per-tp divisor into dtgpt's whole multiple, in place (see the module note).
    `spellings`: how the user wrote each command-line setting, in order; `ignored`: the Megatron
    flags accepted without effect; `levels`: where each key was set."""
    tp = cfg.parallel.tensor_model_parallel_size
    said = [s for s in spellings if s.split()[0].split("=")[0] == FLAG]
    if said:
        last = said[-1]
        divisor = int(last.split("=", 1)[1] if "=" in last.split()[0] else last.split()[1])
        if not any(s.startswith(f"--{KEY}") for s in spellings):
            cfg.model.make_vocab_size_divisible_by = divisor * tp
        return
    if megatron_launch(spellings, ignored, has_file) and KEY not in levels:
        cfg.model.make_vocab_size_divisible_by = MEGATRON_DEFAULT * tp
