"""A skipped test tells the person running the suite what to do to run it, not where the project's own CI runs it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from leantrain import _compat
from tests import _floor


ROOT = Path(__file__).resolve().parents[2]
SKIPS = {"skip", "skipif", "importorskip", "xfail"}
INTERNAL = re.compile(r"\.ci/|\bvenvs?\b|\bCI\b")


def _skip_texts(source: str) -> list[str]:
    """The string parts (f-strings' literal parts included) of every pytest skip / skipif / importorskip / xfail
    call's arguments."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in SKIPS:
            continue
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            texts += [n.value for n in ast.walk(arg) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return texts


def test_the_scan_reads_f_strings_and_keywords():
    source = (
        "pytest.skip(f'transformers {v} the floor venv .ci/venvs/trl-0.29 runs these')\n"
        "@pytest.mark.skipif(x, reason='CI runs it')\ndef f(): pass\n"
    )
    assert [t for t in _skip_texts(source) if INTERNAL.search(t)] == [
        " the floor venv .ci/venvs/trl-0.29 runs these",
        "CI runs it",
    ]


@pytest.mark.parametrize("path", sorted(ROOT.glob("tests/**/*.py")), ids=lambda p: str(p.relative_to(ROOT / "tests")))
def test_skip_reasons_name_no_internal_environment(path):
    bad = [t for t in _skip_texts(path.read_text()) if INTERNAL.search(t)]
    assert not bad, f"{path.relative_to(ROOT)}: a skip reason names the project's own environments: {bad}"


def test_floor_only_tests_say_what_to_install(monkeypatch):
    monkeypatch.setattr(_floor, "installed", lambda package: "5.23.0")
    reason = _floor.floor_only("the per-expert blocks")
    pins = [f"'{p}=={_compat.FLOOR.pin(p)}'" for p in ("transformers", "trl", "peft", "accelerate")]
    assert reason.startswith("transformers 5.23.0: the per-expert blocks exist in transformers < 5.0.0 only")
    assert reason.endswith("pip install " + " ".join(pins))
    monkeypatch.setattr(_floor, "installed", lambda package: _compat.FLOOR.pin("transformers"))
    assert _floor.floor_only("the per-expert blocks") is None
