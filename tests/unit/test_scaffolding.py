"""Tests and benchmarks stand on their own: the import path comes from pyproject's pytest ``pythonpath`` (and
benchmarks/gpu_run.sh's PYTHONPATH), never from ``sys.path`` edits; scaffolding both share lives in ``testkit/``;
a test module is never imported as a helper (helpers are ``_``-prefixed modules or live in ``testkit``)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
TREES = ("tests", "benchmarks", "testkit")


def python_files(*trees: str) -> list[Path]:
    return sorted(p for tree in trees for p in (ROOT / tree).rglob("*.py"))


def trees(path: Path) -> list[ast.AST]:
    """The module's syntax tree, plus those of the scripts it holds in string constants (subprocess bodies)."""
    found, todo = [], [path.read_text()]
    while todo:
        tree = ast.parse(todo.pop())
        found.append(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
                try:  # prose that merely mentions "import " is no script
                    body = textwrap.dedent(node.value)
                    ast.parse(body)
                except SyntaxError:
                    continue
                todo.append(body)
    return found


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (top level or inside a function), ``from a import b`` as both
    ``a`` and ``a.b``."""
    names: set[str] = set()
    for node in (n for tree in trees(path) for n in ast.walk(tree)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def edits_sys_path(path: Path) -> bool:
    """A call of a method on ``sys.path`` (insert, append, extend, remove) anywhere in the module or its scripts."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and ast.unparse(node.func.value) == "sys.path"
        for tree in trees(path)
        for node in ast.walk(tree)
    )


def test_no_sys_path_edits():
    bad = [str(p.relative_to(ROOT)) for p in python_files(*TREES) if edits_sys_path(p)]
    assert not bad, f"path edits (use pyproject's pytest pythonpath / gpu_run.sh's PYTHONPATH): {bad}"


def test_pytest_pythonpath_holds_the_shared_roots():
    line = re.search(r"^pythonpath = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)  # no tomllib on 3.10
    assert line and {".", "benchmarks"} <= set(re.findall(r'"([^"]+)"', line.group(1)))
    gpu_run = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    assert "export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD:" in gpu_run  # the same roots for the scripts


@pytest.mark.parametrize("tree", ["benchmarks", "testkit"])
def test_benchmarks_and_testkit_import_no_test_module(tree):
    bad = {
        str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m == "tests" or m.startswith("tests."))
        for p in python_files(tree)
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"shared scaffolding belongs in testkit/: {bad}"


def test_no_test_module_is_imported_as_a_helper():
    bad = {}
    for path in python_files("tests", "benchmarks", "testkit"):
        hits = sorted(m for m in imported_modules(path) if m.rpartition(".")[2].startswith("test_"))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, f"move what is shared into a _helper module or testkit/: {bad}"
