"""The tested version sets are the one source for pyproject's bounds, the README and COMPATIBILITY.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from leantrain import _compat


ROOT = Path(__file__).resolve().parents[2]


def _pyproject_bounds() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)(>=[^"]*)"', deps))


def test_pyproject_bounds_are_the_tested_range_nothing_wider():
    """Floors are the oldest tested set's pins, caps the latest set's: pip never resolves an untested release (and
    the README's test command resolves exactly the latest set, which CI records in COMPATIBILITY.md)."""
    bounds = _pyproject_bounds()
    for package in ("transformers", "trl", "peft", "accelerate"):
        assert bounds[package] == f">={_compat.FLOOR.pin(package)},<={_compat.LATEST.pin(package)}", package


def test_sets_are_ordered_and_the_latest_is_newest():
    for package in ("transformers", "trl", "peft", "accelerate"):
        versions = [_compat.version_tuple(s.pin(package)) for s in _compat.TESTED_SETS]
        assert versions == sorted(versions), package
    assert _compat.LATEST is _compat.TESTED_SETS[-1] and _compat.FLOOR is _compat.TESTED_SETS[0]


def test_readme_names_every_tested_set():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Compatibility", 1)[1].split("\n## ", 1)[0]
    for s in _compat.TESTED_SETS:
        row = next((line for line in section.splitlines() if f"`{s.name}`" in line), "")
        for package in ("transformers", "trl", "peft", "accelerate"):
            assert f" {s.pin(package)} " in row, (s.name, package, row)


@pytest.mark.parametrize(
    "text,expected",
    [("5.0.0.dev0", (5, 0, 0)), ("2.13.0+cpu", (2, 13, 0)), ("0.29.1", (0, 29, 1)), ("1.14rc1", (1, 14))],
)
def test_version_tuple(text, expected):
    assert _compat.version_tuple(text) == expected


def test_needs_names_the_version_and_the_next_step(monkeypatch):
    monkeypatch.setattr(_compat, "installed", lambda package: "4.57.6")
    reason = _compat.needs("transformers", "5.0.0", "3-D MoE experts")
    assert reason == (
        "needs transformers >= 5.0.0 for 3-D MoE experts; installed 4.57.6: pip install -U 'transformers>=5.0.0'"
    )
    assert _compat.needs("transformers", "4.57.0", "anything") is None
    monkeypatch.setattr(_compat, "installed", lambda package: None)
    assert "installed none" in _compat.needs("trl", "1.15.0", "the fused LM head")


def test_untested_flags_versions_outside_the_range(monkeypatch):
    versions = {"transformers": "4.40.0", "trl": "9.0.0", "peft": _compat.LATEST.pin("peft")}
    monkeypatch.setattr(_compat, "installed", versions.get)
    notes = _compat.untested()
    assert len(notes) == 2 and "transformers 4.40.0" in notes[0] and "trl 9.0.0" in notes[1]


def test_script_prints_pins_for_ci():
    script = ROOT / "src" / "leantrain" / "_compat.py"
    run = [sys.executable, str(script)]
    names = subprocess.run([*run, "names"], capture_output=True, text=True, check=True).stdout.split()
    assert names == [s.name for s in _compat.TESTED_SETS]
    pins = subprocess.run([*run, "pins", names[0]], capture_output=True, text=True, check=True).stdout.split()
    assert f"trl=={_compat.FLOOR.pin('trl')}" in pins and "torch==2.13.0" in pins
    assert subprocess.run([*run, "pins", "nope"], capture_output=True, text=True).returncode == 2


def test_moe4bit_declines_on_transformers_4_naming_the_version(monkeypatch):
    pytest.importorskip("bitsandbytes")
    from leantrain.cli.tiny import linear4bit_experts, tiny_model
    from leantrain.moe4bit import readiness

    moe, plain_moe, dense = (
        tiny_model(f, vocab_size=64, hidden=64, layers=1) for f in ("gpt_oss", "gpt_oss", "llama")
    )
    linear4bit_experts(moe)  # frozen 4-bit experts in gpt-oss' checkpoint layout: served from transformers 5 on
    monkeypatch.setattr(_compat, "installed", lambda package: "4.57.6" if package == "transformers" else None)
    ready = readiness(moe)
    assert ready.reasons == (
        "needs transformers >= 5.0.0 for 3-D MoE experts and their tested call convention; installed 4.57.6: "
        "pip install -U 'transformers>=5.0.0'",
    )
    assert ready.applicable  # a 4-bit MoE: moe4bit would serve it but for the version
    # experts that are not 4-bit: nothing for moe4bit to do, whatever the version (not a version problem)
    plain = readiness(plain_moe)
    assert not plain.applicable and "not 4-bit" in plain.reasons[0]
    assert not readiness(dense).applicable  # no MoE layer: not applicable, whatever the version
