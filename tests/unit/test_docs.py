"""The README and the other docs speak of the product to its users: no notes on which machines were available, how
files travelled, commits that fixed things or issue numbers; the CGGR advice agrees with the defaults it describes;
the test command says what it runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leantrain.config import LeantrainConfig


ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "ARCHITECTURE.md", "COMPATIBILITY.md")
# How the product was built, not what it does: machines lent, wheels carried, commits that mended, issue numbers.
BUILD_NOTES = re.compile(r"\blent\b|\bcarry\b|\bmended\b|(?<![\w&])#\d+|\bthe issue'?s?\b", re.IGNORECASE)


@pytest.mark.parametrize("doc", DOCS)
def test_docs_carry_no_notes_on_how_they_were_built(doc):
    found = [
        f"{doc}:{n}: {line.strip()[:100]}"
        for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1)
        if BUILD_NOTES.search(line)
    ]
    assert not found, "\n".join(found)


def test_cggr_advice_names_the_defaults():
    """Whatever the CGGR section recommends, it starts from the defaults as the config has them."""
    defaults = {f.name: f.default for f in LeantrainConfig.options()}
    readme = (ROOT / "README.md").read_text()
    said = (
        f"The defaults (`{defaults['cggr_scoring']}`, ratio {defaults['cggr_min_tokens_ratio']}, "
        f"depth {defaults['cggr_router_layers']})"
    )
    assert said in readme
    assert "prefer `margin`" not in readme


def test_test_command_says_what_it_runs():
    readme = (ROOT / "README.md").read_text()
    intro = readme[: readme.index("<!-- test-command -->")].strip().rsplit("\n\n", 1)[-1]
    assert intro.startswith("Tests (") and "whole suite on CPU" in intro and "CUDA tests" in intro
    assert "parity suite on CPU" not in readme
