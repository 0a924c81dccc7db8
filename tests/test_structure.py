"""The package's shape (DESIGN, "Layout"): the library is the trainer's base, one public name
means one thing, faults have a package of their own, and no module outgrows a sitting."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dtgpt"
MAX_LINES = 400
# Above the trainer: the command line runs pretrain(), and the package's lazy pretrain attribute.
TRAINER_USERS = {"dtgpt/cli.py", "dtgpt/__init__.py"}


def modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE.parent)): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(tree: ast.Module) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def public_definitions(tree: ast.Module) -> list[str]:
    """Top-level functions and classes without a leading underscore (imports are not definitions)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [node.name for node in tree.body if isinstance(node, kinds) and not node.name.startswith("_")]


def test_the_library_never_imports_the_trainer():
    importers = {name for name, tree in modules().items() if "dtgpt.training" in imported_modules(tree)}
    assert "dtgpt/api.py" not in importers
    assert importers <= TRAINER_USERS, f"only the front end may import the trainer: {sorted(importers - TRAINER_USERS)}"


def test_one_public_name_is_defined_in_one_module():
    where = defaultdict(list)
    for name, tree in modules().items():
        for definition in public_definitions(tree):
            where[definition].append(name)
    twice = {definition: files for definition, files in where.items() if len(files) > 1}
    assert not twice, f"public names defined in more than one module: {twice}"


def test_faults_and_megatron_interop_have_packages_of_their_own():
    faults = {p.name for p in (PACKAGE / "faults").glob("*.py")}
    assert {"signals.py", "injection.py", "last_words.py", "attempt_store.py", "watchdog.py"} <= faults
    megatron = {p.name for p in (PACKAGE / "checkpoint" / "megatron").glob("*.py")}
    assert {"load.py", "write.py"} <= megatron
    stray = [p.name for p in PACKAGE.glob("*.py") if p.stem in {"exits", "faults", "last_words", "attempt_store", "watchdog"}]
    assert not stray


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules: {long}"


def test_the_checker_sees_a_duplicate_and_an_import(tmp_path):
    """The checks above can fail: two definitions of one name, and an import inside a function."""
    tree = ast.parse("def build(): pass\nclass Thing: pass\ndef _private(): pass\ndef f():\n    from dtgpt.training import x\n")
    assert public_definitions(tree) == ["build", "Thing", "f"]
    assert "dtgpt.training" in imported_modules(tree)
