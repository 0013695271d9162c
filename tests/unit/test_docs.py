"""The README and the other docs speak of the product to its users: no notes on which machines were available, how
files travelled, commits that fixed things, commit hashes or issue numbers; the README is a product page (short,
what it is and the two set-up commands first, its links resolve); the CGGR advice agrees with the defaults it
describes; the test command says what it runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leantrain.config import LeantrainConfig


ROOT = Path(__file__).resolve().parents[2]
DOCS = (
    "README.md",
    "ARCHITECTURE.md",
    "COMPATIBILITY.md",
    *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/**/*.md")),
)
# How the product was built, not what it does: machines lent, wheels carried, commits that mended, issue numbers.
BUILD_NOTES = re.compile(
    r"\blent\b|\bcarry\b|\bcarried\b|\bwheels?\b|\bmended\b|(?<![\w&])#\d+|\bthe issue'?s?\b|\bcommits?\b [0-9a-f]",
    re.IGNORECASE,
)
# A commit hash in prose: 7 to 40 hex digits with at least one letter and one digit (not a number, not a word).
HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
README_LINES = 300
# How the project is built and checked, not what a user gets: CI's jobs, packaging files, the project's environments.
PROCESS = re.compile(r"\bCI\b|pyproject|\.ci/|\bvenvs?\b")


def _prose(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks (a console transcript may print hex)."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def test_docs_exist_beyond_the_readme():
    assert len(DOCS) > 3 and "docs/results.md" in DOCS and "docs/compare.md" in DOCS


@pytest.mark.parametrize("doc", DOCS)
def test_docs_carry_no_notes_on_how_they_were_built(doc):
    found = [
        f"{doc}:{n}: {line.strip()[:100]}" for n, line in _prose((ROOT / doc).read_text()) if BUILD_NOTES.search(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("doc", DOCS)
def test_docs_carry_no_commit_hashes(doc):
    found = [
        f"{doc}:{n}: {HASH.search(line).group()}" for n, line in _prose((ROOT / doc).read_text()) if HASH.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_look_for():
    """The patterns are not vacuous: each catches a line of the kind it is meant to keep out."""
    assert HASH.search("measured at commit 4b192e3 on an H100") and HASH.search("(cd09977)")
    assert not HASH.search("2026-11-25, 1024 tokens, deadbeef-free, sm90, 0x1f, bf16")
    for line in ("fixed in #42", "a GPU was lent", "built wheels", "mended in", "commits 94a75e5"):
        assert BUILD_NOTES.search(line), line


def test_readme_is_a_product_page():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) < README_LINES, f"README.md has {len(lines)} lines: move detail into docs/"
    head = "\n".join(lines[: readme[: readme.index("<!-- test-command -->")].count("\n") + 4])
    assert head.count("```bash") == 2, "the first lines hold exactly the two set-up commands: the demo and the tests"
    assert "leantrain demo" in head and "python -m pytest" in head
    assert "GPU results" in readme and "CPU" in readme[: readme.index("```bash")]
    sections = [line for line in lines if line.startswith("## ")]
    assert sections[:3] == ["## What the one line buys (GPU)", "## Usage", "## Compatibility"], sections


def test_readme_usage_and_compatibility_state_the_product():
    """Those sections say what a user gets (the options, the tested version sets, what happens outside them), not how
    CI or packaging gets there."""
    readme = (ROOT / "README.md").read_text()
    for section in ("## Usage", "## Compatibility"):
        text = readme.split(f"\n{section}\n", 1)[1].split("\n## ", 1)[0]
        found = [line.strip()[:100] for _, line in _prose(text) if PROCESS.search(line)]
        assert not found, f"{section}: " + "\n".join(found)
    for line in ("CI runs the full suite", "pyproject admits exactly", "the floor venv .ci/venvs/trl-0.29"):
        assert PROCESS.search(line), line


def test_readme_links_resolve_or_are_announced():
    """Every relative link of the README points at a file, except pages other parts of the project add."""
    readme = (ROOT / "README.md").read_text()
    pending = {"docs/compile_layers.md", "docs/distributed.md", "docs/benchmarks_vs_unsloth.md"}
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if "://" not in target and target not in pending:
            assert (ROOT / target).exists(), target


def test_cggr_advice_names_the_defaults():
    """Whatever the CGGR page recommends, it starts from the defaults as the config has them."""
    defaults = {f.name: f.default for f in LeantrainConfig.options()}
    page = (ROOT / "docs" / "optimizations" / "cggr.md").read_text()
    said = (
        f"The defaults (`{defaults['cggr_scoring']}`, ratio {defaults['cggr_min_tokens_ratio']}, "
        f"depth {defaults['cggr_router_layers']})"
    )
    assert said in page
    assert "prefer `margin`" not in page


def test_test_command_says_what_it_runs():
    readme = (ROOT / "README.md").read_text()
    intro = readme[: readme.index("<!-- test-command -->")].strip().rsplit("\n\n", 1)[-1]
    assert intro.startswith("Tests (") and "whole suite on CPU" in intro and "CUDA tests" in intro
    assert "marked `slow`" in intro and "-m slow" in intro and "minutes" in intro
    assert "parity suite on CPU" not in readme


def test_ci_runs_what_the_readme_command_leaves_out():
    """The README's command deselects the tests marked slow; CI runs it verbatim, then exactly those: every test."""
    readme = (ROOT / "README.md").read_text()
    command = readme.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert command.startswith("python3 ") and command.endswith('python -m pytest -q -m "not slow"')
    ci = (ROOT / ".ci" / "run").read_text()
    assert "awk '/<!-- test-command -->/" in ci and 'python -m pytest -q -m slow -p no:cacheprovider"' in ci


def test_slow_files_exist():
    """The conftest's table of slow files names files that exist: a renamed file would silently join the README's
    command."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_tests_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    for rel in conftest.SLOW_FILES:
        assert (ROOT / "tests" / rel).is_file(), rel
    for folder in conftest.SLOW_DIRS:
        assert (ROOT / "tests" / folder).is_dir(), folder
