"""The docs' generated blocks: text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in a doc, made from
the option table (``leantrain.config``) and the command-line parsers, so that no doc lists keywords, variables or
flags by hand. ``tests/unit/test_doc_blocks.py`` checks every block; from the repository root,
``python -m testkit.doc_blocks`` rewrites the stale ones.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from leantrain import config


ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m testkit.doc_blocks"


@dataclass(frozen=True)
class Block:
    doc: str  # path from the repository root
    name: str  # the marker's name
    render: Callable[[], str]


def fenced(language: str, text: str) -> str:
    return f"```{language}\n{text}\n```"


def _invocation(action: argparse.Action) -> str:
    """How an option is typed, as ``--help`` shows it, each spelling in its own code span: ``--cggr``, ``--no-cggr``;
    ``--steps STEPS``."""
    names = action.option_strings or [action.dest]
    if action.nargs != 0:
        metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
        names = [f"{name} {metavar}" for name in names]
    return ", ".join(f"`{name}`" for name in names)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The option's help with argparse's ``%(default)s``-style fields filled in, as ``--help`` prints it."""
    text = action.help or ""
    if "%" in text:
        text = text % {**vars(action), "prog": parser.prog}
    return " ".join(text.split()).replace("|", "\\|").replace("<", "\\<")  # a cell: no pipe, no HTML tag


def flags_markdown(parser: argparse.ArgumentParser) -> str:
    """A parser's usage and its options (those ``--help`` shows, ``--help`` itself left out) as a table."""
    if not parser.usage:
        raise ValueError(f"{parser.prog}: the parser has no usage string to show")
    rows = ["| option | what it does |", "| --- | --- |"]
    # argparse keeps its options in the private _actions only; read at generation time, so a new flag appears.
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or "--help" in action.option_strings:
            continue
        rows.append(f"| {_invocation(action)} | {_help(parser, action)} |")
    return fenced("text", parser.usage) + "\n\n" + "\n".join(rows)


def _run_flags() -> str:
    from leantrain.cli import launch

    return flags_markdown(launch.build_parser())


def _compare_flags() -> str:
    from leantrain.cli import compare

    return flags_markdown(compare.build_parser())


def _signature() -> str:
    return fenced("python", config.patch_trainer_signature())


BLOCKS: tuple[Block, ...] = (
    Block("README.md", "patch-signature", _signature),
    Block("README.md", "env-table", config.env_table_markdown),
    Block("docs/configuration.md", "patch-signature", _signature),
    Block("docs/configuration.md", "options-table", config.options_table_markdown),
    Block("docs/run.md", "run-flags", _run_flags),
    Block("docs/run.md", "compare-flags", _compare_flags),
)


def _pattern(name: str) -> re.Pattern[str]:
    # The body ends with its own newline, so a freshly added pair of markers (nothing between them) matches too.
    return re.compile(rf"(<!-- {re.escape(name)}:start -->\n)(.*?)(<!-- {re.escape(name)}:end -->)", re.S)


def current(text: str, block: Block) -> str:
    """The block's text as the doc has it; a doc without exactly one pair of its markers is an error."""
    found = _pattern(block.name).findall(text)
    if len(found) != 1:
        raise ValueError(f"{block.doc}: expected one <!-- {block.name}:start/end --> pair, found {len(found)}")
    return found[0][1]


def stale(root: Path = ROOT) -> list[str]:
    """``doc: name`` of every block whose text differs from what its generator makes now."""
    return [
        f"{block.doc}: {block.name}"
        for block in BLOCKS
        if current((root / block.doc).read_text(), block) != block.render() + "\n"
    ]


def write(root: Path = ROOT) -> list[str]:
    """Rewrite every stale block in place; returns the ones rewritten."""
    rewritten = []
    for block in BLOCKS:
        path = root / block.doc
        text = path.read_text()
        body = block.render() + "\n"
        if current(text, block) != body:
            path.write_text(_pattern(block.name).sub(lambda m: m.group(1) + body + m.group(3), text))
            rewritten.append(f"{block.doc}: {block.name}")
    return rewritten


def main() -> int:
    rewritten = write()
    print("\n".join(f"rewrote {name}" for name in rewritten) or "every generated block is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
