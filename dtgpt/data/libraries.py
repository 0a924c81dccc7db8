"""What a tokenizer needs before it is built: its optional library (`tokenizers`, `sentencepiece`,
`tiktoken`: each a pip extra of dtgpt, never a runtime dependency) and its model file. Either
missing is a user error of one line."""

from __future__ import annotations

import importlib
import json
import os

from dtgpt.config.tokenizer_rules import LIBRARIES
from dtgpt.data.indexed import DataError, DataFileNotFoundError


class PickledAsArguments:
    """A tokenizer whose library object does not pickle: it pickles as its constructor's arguments
    (`_arguments`, set by its __init__) and is rebuilt from its files where it is unpickled, in each
    DataLoader or preprocessing worker."""

    _arguments: tuple = ()

    def __reduce__(self):
        return type(self), self._arguments


class MissingLibraryError(DataError, ImportError):
    """An optional library the config needs is not installed: a user error (one line), and still
    an ImportError to code that asks for one."""


def import_library(kind: str):
    """The library tokenizer type `kind` runs on, or a MissingLibraryError naming the pip extra."""
    library, extra = LIBRARIES[kind]
    try:
        return importlib.import_module(library)
    except ImportError:
        raise MissingLibraryError(f"{kind} needs the '{library}' library: pip install 'dtgpt[{extra}]'") from None


def model_file(kind: str, path: str, what: str) -> str:
    """`path` when it is a file; else a DataFileNotFoundError naming data.tokenizer_model and what
    `kind` reads (dtgpt downloads nothing)."""
    if not os.path.isfile(path):
        problem = "a directory, not a file" if os.path.isdir(path) else "no such file"
        raise DataFileNotFoundError(f"data.tokenizer_model={path!r}: {problem} ({kind} reads {what}; dtgpt downloads nothing)")
    return path


def json_file(path: str, expected: type, what: str):
    """A JSON file's content of type `expected` (dict, list); else a DataError saying `what` it should hold."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, expected):
        raise DataError(f"{path}: holds a JSON {type(data).__name__}, not {what}")
    return data
