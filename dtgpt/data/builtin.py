"""A built-in corpus that needs no download: the docstrings of the installed Python standard library.

`data.builtin_corpus = "python-docstrings"` walks the stdlib directory in sorted order, parses each
module with `ast` (files that fail to parse are skipped), takes the module, class and function
docstrings up to a byte cap, writes them as JSONL and runs the real preprocessing path on it
(ByteTokenizer, eod appended). The result is cached under `{data_cache_path}/builtin/` keyed by the
Python version and the cap, so it is built once (a few seconds) and reused.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from typing import Iterator, Optional

from dtgpt.config import DataConfig
from dtgpt.data.cache import build_once
from dtgpt.data.indexed import exists as indexed_exists
from dtgpt.data.preprocess import output_prefix, preprocess

CORPORA = ("python-docstrings",)
DEFAULT_MAX_BYTES = 8 * 2**20
"""Cap on docstring text. CPython 3.11's stdlib (tests excluded) holds about 1.8 MB, all of it fits."""
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_files(root: str) -> Iterator[str]:
    """The stdlib's .py files in a fixed order; installed packages and test suites left out."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def gather_docstrings(root: str, max_bytes: int) -> Iterator[str]:
    """Module, class and function docstrings in source order until max_bytes of UTF-8 text."""
    total = 0
    for path in stdlib_files(root):
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, _DOC_NODES):
                continue
            doc = ast.get_docstring(node, clean=True)
            if not doc:
                continue
            size = len(doc.encode("utf-8"))
            if total + size > max_bytes:
                return
            total += size
            yield doc


def corpus_prefix(cache_root: str, name: str, max_bytes: int) -> str:
    """Indexed dataset prefix of a built-in corpus; the key is the interpreter version and the cap."""
    impl = sys.implementation.name
    version = ".".join(map(str, sys.version_info[:3]))
    directory = os.path.join(cache_root, "builtin", f"{name}-{impl}{version}-cap{max_bytes}")
    return output_prefix(os.path.join(directory, name), "text")


def build_builtin_corpus(cache_root: str, name: str = "python-docstrings", max_bytes: Optional[int] = None) -> str:
    """Build the corpus once (rank 0 builds, others wait) and return its indexed dataset prefix."""
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if name not in CORPORA:
        raise ValueError(f"data.builtin_corpus={name!r} is not one of {CORPORA}")
    prefix = corpus_prefix(cache_root, name, max_bytes)
    directory = os.path.dirname(prefix)

    def build() -> None:
        os.makedirs(directory, exist_ok=True)
        jsonl = os.path.join(directory, f"{name}.jsonl")
        tmp = f"{jsonl}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in gather_docstrings(sysconfig.get_paths()["stdlib"], max_bytes):
                f.write(json.dumps({"text": doc}) + "\n")
        os.replace(tmp, jsonl)
        with open(os.devnull, "w") as quiet:
            preprocess(jsonl, os.path.join(directory, name), DataConfig(tokenizer_type="ByteTokenizer"),
                       append_eod=True, workers=1, log=quiet)

    build_once(lambda: indexed_exists(prefix), build)
    return prefix
