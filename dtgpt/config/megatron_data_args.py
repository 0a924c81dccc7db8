"""Megatron's blend read from a file: `--data-args-path F` (the words of `--data-path`, as long
blends are kept) and `--per-split-data-args-path F` (JSON: the `--train-data-path`,
`--valid-data-path` and `--test-data-path` lists under "train", "valid" and "test", each a list
of words or one string of them).

The file is read when the command line is translated, so a missing, unreadable or malformed one
is one error line naming the flag and the file, before anything starts; its words become the
overrides of data.data_path or of the three per-split keys, as if they had been typed.
"""

from __future__ import annotations

import json
from pathlib import Path

from dtgpt.config.sections import ConfigError

DATA_ARGS_PATH = "data-args-path"
PER_SPLIT_DATA_ARGS_PATH = "per-split-data-args-path"
SPLITS = ("train", "valid", "test")


def toml_list(values: list[str]) -> str:
    """The override text of a list of words: a TOML list, so that a word holding a comma stays one."""
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def data_args_overrides(flag: str, path: str) -> list[tuple[str, str, str]]:
    """(section.key, value as text, spelling) for each data key `--flag path` sets."""
    spelling = f"--{flag} {path}"
    text = _read(spelling, path)
    if flag == DATA_ARGS_PATH:
        words = text.split()
        if not words:
            raise ConfigError(f"{spelling}: the file holds no blend (Megatron reads the words of --data-path from it)")
        return [("data.data_path", toml_list(words), spelling)]
    per_split = _json(spelling, text)
    return [(f"data.{split}_data_path", toml_list(_words(spelling, split, per_split[split])), spelling) for split in SPLITS]


def _read(spelling: str, path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{spelling}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{spelling}: not a text file") from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"{spelling}: cannot be read ({e.strerror})") from None


def _json(spelling: str, text: str) -> dict:
    shape = 'Megatron reads {"train": [...], "valid": [...], "test": [...]}'
    try:
        per_split = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{spelling}: malformed JSON ({e.msg}, line {e.lineno} column {e.colno}); {shape}") from None
    missing = [s for s in SPLITS if not isinstance(per_split, dict) or s not in per_split]
    if missing:
        raise ConfigError(f"{spelling}: no {', '.join(repr(s) for s in missing)} in it; {shape}")
    return per_split


def _words(spelling: str, split: str, value) -> list[str]:
    """A split's blend: a string of words, or a list of them (each entry may hold several)."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return [word for v in value for word in str(v).split()]
    raise ConfigError(f"{spelling}: {split!r} is {json.dumps(value)}; it must be a list of weights and paths, or one string of them")
