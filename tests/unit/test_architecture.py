"""The package's shape, checked from the source: which module may import which (ARCHITECTURE.md says why).

Layers, top to bottom: the command line (``cli``: run, compare, demo, env, and ``__main__`` that calls it), the
entry point (``leantrain``, ``entry``), the optimizations (one package each, named in ``config.OPTIMIZATIONS``),
the framework (interface, undo, options, report, model adapters, versions) and the shared math (every other
subpackage, e.g. ``lm_head``). An import may only run down; math takes plain values and imports no framework
module. Which modules of an optimization are its math is read from ARCHITECTURE.md's package table (the "math"
column), plus what those modules import inside the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from leantrain.config import OPTIMIZATIONS


ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "leantrain"
CLI = "cli"  # the command line: the top layer, every module under src/leantrain/cli/ and the root's __main__
# The entry point: the public surface and the command line above it. Derived from the tree, not listed.
ENTRY = {"leantrain", "leantrain.entry"}
# Math that several optimizations share: every subpackage that is neither an optimization nor the command line.
# Plain values, and no optimization, framework or entry point above it.
SHARED_MATH = tuple(
    sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists() and p.name not in (*OPTIMIZATIONS, CLI))
)
FRAMEWORK_FOR_MATH = {
    "leantrain.config",
    "leantrain.fallback",
    "leantrain.undo",
    "leantrain.optimization",
    "leantrain._record",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every leantrain module ``path`` imports, at module level or inside a function (lazy imports count)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("leantrain")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith("leantrain"):
                continue
            # `from . import ops` names a submodule; `from .config import X` names the module itself
            subs = {f"{target}.{a.name}" for a in node.names}
            found |= {s for s in subs if _exists(s)} or {target}
    return found


def _exists(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


GRAPH = {module_name(p): imports(p) for p in SRC.rglob("*.py")}
COMMAND_LINE = {m for m in GRAPH if m.startswith(f"leantrain.{CLI}") or m == "leantrain.__main__"}
ENTRY |= COMMAND_LINE


def documented_math(package: str) -> tuple[str, ...]:
    """The ``*.py`` files in the "math" column (the last) of ARCHITECTURE.md's row for ``package``."""
    rows = [
        line for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines() if line.startswith(f"| `{package}` |")
    ]
    assert rows, f"ARCHITECTURE.md has no package-table row for {package}"
    return tuple(re.findall(r"`([A-Za-z_]\w*)\.py`", rows[-1].rstrip(" |").rsplit("|", 1)[-1]))


def math_modules(package: str) -> list[str]:
    """The documented math modules and everything they import inside the package: math only calls math."""
    prefix = f"leantrain.{package}."
    found: list[str] = []
    todo = [prefix + name for name in documented_math(package)]
    while todo:
        module = todo.pop()
        if module not in found:
            found.append(module)
            todo += [d for d in GRAPH.get(module, ()) if d.startswith(prefix)]
    return found


@pytest.mark.parametrize("package", OPTIMIZATIONS)
def test_no_optimization_imports_the_entry_point(package):
    prefix = f"leantrain.{package}"
    bad = {m: sorted(deps & ENTRY) for m, deps in GRAPH.items() if m.startswith(prefix) and deps & ENTRY}
    assert not bad, f"imports running back up into the entry point: {bad}"


@pytest.mark.parametrize("package", OPTIMIZATIONS)
def test_optimizations_do_not_import_each_other(package):
    """Math two optimizations need lives in a shared math package (CGGR and GRPO score tokens with ``lm_head``)."""
    prefix = f"leantrain.{package}"
    for module, deps in GRAPH.items():
        if module.startswith(prefix):
            others = [d for d in deps if any(d.startswith(f"leantrain.{o}") for o in OPTIMIZATIONS if o != package)]
            assert not others, f"{module} imports {others}: move shared math to {SHARED_MATH}"


@pytest.mark.parametrize("package", SHARED_MATH)
def test_shared_math_takes_plain_values(package):
    prefix = f"leantrain.{package}"
    modules = [m for m in GRAPH if m.startswith(prefix)]
    assert modules, f"{prefix} does not exist"
    for module in modules:
        bad = {d for d in GRAPH[module] if d.startswith("leantrain") and not d.startswith(prefix)}
        assert not bad, f"{module} (shared math) imports {sorted(bad)}"


def test_framework_imports_no_optimization_or_entry_point():
    framework = [m for m in GRAPH if m not in ENTRY and not any(m.startswith(f"leantrain.{o}") for o in OPTIMIZATIONS)]
    for module in framework:
        above = {d for d in GRAPH[module] if d in ENTRY or any(d.startswith(f"leantrain.{o}") for o in OPTIMIZATIONS)}
        assert not above, f"framework module {module} imports {sorted(above)}"


@pytest.mark.parametrize("package", OPTIMIZATIONS)
def test_math_takes_plain_values(package):
    for module in math_modules(package):
        assert module in GRAPH, f"{module} is listed as math (ARCHITECTURE.md) but does not exist"
        bad = GRAPH[module] & (FRAMEWORK_FOR_MATH | ENTRY)
        assert not bad, f"{module} (math) imports {sorted(bad)}"


def test_math_tables_derived_from_the_docs_and_the_imports():
    """The derivation finds at least what is math today (more may come: these are floors, not lists to edit)."""
    assert "lm_head" in SHARED_MATH and not set(SHARED_MATH) & set(OPTIMIZATIONS)
    found = {package: {m.rpartition(".")[2] for m in math_modules(package)} for package in ("cggr", "osft", "moe4bit")}
    assert found["cggr"] >= {"ops"} and found["osft"] >= {"ops", "linear", "_triton"}
    assert found["moe4bit"] >= {"ops", "_stacks", "_qstate", "lora"}


def test_no_import_cycle():
    """Tarjan over the whole graph: every strongly connected component is one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in list(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_nothing_below_imports_the_command_line():
    """The command line only calls the library: no framework, optimization or math module imports ``cli``, and the
    entry point (``leantrain``, ``entry``) does not either."""
    assert {"leantrain.cli", "leantrain.cli.compare", "leantrain.cli.verdict"} <= COMMAND_LINE
    bad = {m: sorted(GRAPH[m] & COMMAND_LINE) for m in GRAPH if m not in COMMAND_LINE and GRAPH[m] & COMMAND_LINE}
    assert not bad, f"imports running up into the command line: {bad}"


def test_the_library_root_holds_the_entry_point_and_the_framework_only():
    """The command-line modules live in ``cli/``: the root keeps only ``__main__`` (a call into ``cli``)."""
    stray = {"launch", "compare", "demo", "tiny", "_measure", "_keep"} & {p.stem for p in SRC.glob("*.py")}
    assert not stray, f"command-line modules at the library root: {sorted(stray)}"


def test_compare_and_demo_share_one_verdict():
    """The statistics and the verdict are one module; compare and demo both conclude with it."""
    for user in ("leantrain.cli.compare", "leantrain.cli.demo"):
        assert "leantrain.cli.verdict" in GRAPH[user], f"{user} does not use leantrain.cli.verdict"
    assert not GRAPH["leantrain.cli.verdict"] - {"leantrain.cli._measure"}


def test_no_test_scaffolding_in_the_package():
    assert not list(SRC.rglob("testing.py")), "test helpers live under tests/"


# ------------------------------------------------------------------------------ the role table's imports column
ROLES = ("__init__", "probe", "patch", "ops", "_triton")


def documented_imports() -> dict[str, str]:
    """Each role's cell in the "imports" column (the last) of ARCHITECTURE.md's role table, by role."""
    cells = {}
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        match = re.match(r"\| `(\w+)\.py` \| .* \| ([^|]*) \|$", line)
        if match and match.group(1) in ROLES:
            cells[match.group(1)] = match.group(2)
    assert set(cells) == set(ROLES), f"ARCHITECTURE.md's role table lacks rows for {set(ROLES) - set(cells)}"
    return cells


def allowed_imports(cell: str, package: str) -> tuple[set[str], set[str]]:
    """(the leantrain modules a role file of ``package`` may import, the framework modules the cell names)."""
    named = {f"leantrain.{n}" for n in re.findall(r"`([A-Za-z_]\w*)`", cell)}
    for module in named:
        assert _exists(module), f"ARCHITECTURE.md's imports column names {module}, which does not exist"
    allowed = set(named)
    if "its own modules" in cell:
        allowed |= {m for m in GRAPH if m.startswith(f"leantrain.{package}.")}
    if "its math" in cell:
        allowed |= set(math_modules(package))
    if "shared math" in cell:
        allowed |= {m for m in GRAPH if any(m.startswith(f"leantrain.{s}") for s in SHARED_MATH)}
    return allowed, named


def role_module(package: str, role: str) -> str:
    return f"leantrain.{package}" if role == "__init__" else f"leantrain.{package}.{role}"


@pytest.mark.parametrize("role", ROLES)
def test_imports_column_is_the_import_graph(role):
    """Every optimization's file of this role imports nothing beyond the column; every framework module the column
    names is imported by some optimization's file of this role (the column is neither too tight nor stale)."""
    cell = documented_imports()[role]
    used: set[str] = set()
    for package in OPTIMIZATIONS:
        module = role_module(package, role)
        if module not in GRAPH:
            continue
        allowed, named = allowed_imports(cell, package)
        beyond = sorted(GRAPH[module] - allowed - {f"leantrain.{package}"})
        assert not beyond, f"{module} imports {beyond}, beyond ARCHITECTURE.md's imports column: {cell!r}"
        used |= GRAPH[module] & named
    _, named = allowed_imports(cell, OPTIMIZATIONS[0])
    assert used == named, f"ARCHITECTURE.md names {sorted(named - used)} for {role}.py, which no package imports there"


def test_framework_table_lists_every_framework_module():
    """The framework file table names every top-level module and shared package (trl_head.py, measured.py...)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    for path in sorted(SRC.iterdir()):
        name = path.name
        if name.startswith("__") or name == "_version.py" or name in {f"{o}" for o in OPTIMIZATIONS}:
            continue
        if path.suffix == ".py" or (path / "__init__.py").exists():
            shown = f"`{name}`" if path.suffix == ".py" else f"`{name}/`"
            assert shown in text, f"ARCHITECTURE.md's file table does not list {shown}"
