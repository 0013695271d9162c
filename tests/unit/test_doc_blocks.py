"""The docs' lists of keywords, options, variables and flags are generated (testkit/doc_blocks.py) from the option
table and the command-line parsers: every generated block matches what its generator makes now."""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
from pathlib import Path

import pytest

from leantrain import patch_trainer
from leantrain.config import CGGR_SCORINGS, OPTIMIZATIONS, options_table_markdown, patch_trainer_signature
from testkit import doc_blocks


ROOT = Path(__file__).resolve().parents[2]


def test_every_generated_block_is_current():
    stale = doc_blocks.stale(ROOT)
    assert not stale, (
        f"generated blocks out of date: {', '.join(stale)}; regenerate them from the repository root with "
        f"`{doc_blocks.COMMAND}`"
    )


def _block(doc: str, name: str) -> str:
    block = next(b for b in doc_blocks.BLOCKS if (b.doc, b.name) == (doc, name))
    return doc_blocks.current((ROOT / doc).read_text(), block)


@pytest.mark.parametrize("name", OPTIMIZATIONS)
def test_docs_name_every_optimization_wherever_they_list_them(name):
    for doc in ("README.md", "docs/configuration.md"):
        assert f"{name}=None" in _block(doc, "patch-signature"), doc
    assert f"| `{name}` | `LEANTRAIN_{name.upper()}` |" in _block("docs/configuration.md", "options-table")
    flag = "--" + name.replace("_", "-")
    assert f"`{flag}`, `--no-{flag[2:]}`" in _block("docs/run.md", "run-flags")


def test_documented_signature_is_patch_trainers_own():
    """The generated signature lists the function's keyword-only parameters in their order (``environ``, the
    environment to read in place of os.environ, is left to the docstring)."""
    params = inspect.signature(patch_trainer).parameters
    keywords = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n != "environ"]
    text = patch_trainer_signature()
    assert re.findall(r"(\w+)=None", text) == keywords
    assert "**options" in text and all(len(line) <= 119 for line in text.splitlines())


def test_compare_flags_come_from_its_parser():
    from leantrain.cli.compare import build_parser

    block = _block("docs/run.md", "compare-flags")
    shown = [a for a in build_parser()._actions if "--help" not in a.option_strings]
    assert shown and all(f"`{a.option_strings[0]}" in block for a in shown)


def test_flags_table_shows_what_help_shows():
    parser = argparse.ArgumentParser(prog="tool", usage="tool [options] TARGET")
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None, help="go fast | or not")
    parser.add_argument("--steps", type=int, default=7, help="steps (default %(default)s)")
    parser.add_argument("--opt", action="append", metavar="NAME=VALUE", help="set <name>")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    assert doc_blocks.flags_markdown(parser) == (
        "```text\ntool [options] TARGET\n```\n\n"
        "| option | what it does |\n| --- | --- |\n"
        "| `--fast`, `--no-fast` | go fast \\| or not |\n"
        "| `--steps STEPS` | steps (default 7) |\n"
        "| `--opt NAME=VALUE` | set \\<name> |"
    )


def test_flags_table_needs_a_usage_line():
    with pytest.raises(ValueError, match="no usage string"):
        doc_blocks.flags_markdown(argparse.ArgumentParser(prog="tool"))


def test_options_table_lists_the_choices_of_a_named_option():
    row = next(line for line in options_table_markdown().splitlines() if line.startswith("| `cggr_scoring` |"))
    assert f"| {', '.join(CGGR_SCORINGS)} |" in row


def _copy_docs(tmp_path: Path) -> Path:
    for doc in {b.doc for b in doc_blocks.BLOCKS}:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, tmp_path / doc)
    return tmp_path


def test_write_rewrites_a_stale_block_and_leaves_the_rest(tmp_path):
    root = _copy_docs(tmp_path)
    page = root / "docs" / "run.md"
    good = page.read_text()
    page.write_text(good.replace("<!-- run-flags:start -->\n", "<!-- run-flags:start -->\n| `--gone` | old |\n"))
    assert doc_blocks.stale(root) == ["docs/run.md: run-flags"]
    assert doc_blocks.write(root) == ["docs/run.md: run-flags"]
    assert page.read_text() == good and doc_blocks.stale(root) == [] and doc_blocks.write(root) == []


def test_empty_markers_are_filled_and_missing_ones_are_an_error(tmp_path):
    root = _copy_docs(tmp_path)
    page = root / "docs" / "configuration.md"
    good = page.read_text()
    start, end = "<!-- options-table:start -->\n", "<!-- options-table:end -->"
    page.write_text(good[: good.index(start) + len(start)] + good[good.index(end) :])
    assert doc_blocks.write(root) == ["docs/configuration.md: options-table"] and page.read_text() == good
    page.write_text(good.replace(end, ""))
    with pytest.raises(ValueError, match="options-table"):
        doc_blocks.stale(root)
