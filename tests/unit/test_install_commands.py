"""Every install command leantrain shows works where a user pastes it: leantrain itself installs from a clone of its
repository (it is not on PyPI), so no command names ``leantrain`` or ``leantrain[extra]`` as a package to fetch;
the optional packages are named by their own names, with pyproject.toml's floors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leantrain.optimization import EXTRAS, install_command, optional_import_reason


ROOT = Path(__file__).resolve().parents[2]
SCANNED = (
    *sorted(ROOT.glob("*.md")),
    *sorted(ROOT.glob("docs/**/*.md")),
    *sorted(ROOT.glob("src/**/*.py")),
    *sorted(ROOT.glob("examples/**/*.py")),
)
# What follows "pip install" up to the end of the command: a line end, a code span's end, or a shell separator.
COMMAND = re.compile(r"pip install\b([^\n`;|&]*)")
# A requirement that names leantrain as a package: a bare name, with or without extras or a version (paths such as
# ".[kernels]" or "./leantrain[bnb]" install from a clone and are fine).
LEANTRAIN = re.compile(r"^leantrain(\[[^\]]*\])?([<>=!~].*)?$", re.IGNORECASE)
QUOTES = "'\"),.:;"


def _requirements(text: str) -> list[str]:
    """The arguments of every ``pip install`` in the text, unquoted, options left out."""
    found = []
    for match in COMMAND.finditer(text):
        found += [token.strip(QUOTES) for token in match.group(1).split() if not token.startswith("-")]
    return found


def _pypi_forms(text: str) -> list[str]:
    return [req for req in _requirements(text) if LEANTRAIN.match(req)]


def _pyproject_extras() -> dict[str, list[str]]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {
        name: re.findall(r'"([^"]+)"', body) for name, body in re.findall(r"^(\w+) = \[(.*?)\]$", section, re.M | re.S)
    }


def test_the_scan_finds_what_it_looks_for():
    assert _pypi_forms("pip install 'leantrain[kernels]'") == ["leantrain[kernels]"]
    assert _pypi_forms('`pip install "leantrain[bnb]"`, CUDA') == ["leantrain[bnb]"]
    assert _pypi_forms("f'...: pip install leantrain[{extra}]'") == ["leantrain[{extra}]"]
    assert _pypi_forms("pip install -U leantrain") == ["leantrain"]
    assert _pypi_forms("pip install leantrain==0.1.0 && leantrain demo") == ["leantrain==0.1.0"]
    for fine in (
        'pip install -e ".[kernels]"',
        "pip install -e ./leantrain[bnb]",
        "pip install 'liger-kernel>=0.8.5'",
    ):
        assert _pypi_forms(fine) == [], fine


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_install_command_asks_pypi_for_leantrain(path):
    bad = _pypi_forms(path.read_text())
    assert not bad, f"{path.relative_to(ROOT)}: pip install {bad}: leantrain is not on PyPI; name the package itself"


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: str(p.relative_to(ROOT)))
def test_optional_packages_are_installed_with_pyprojects_floor(path):
    floors = dict(req.split(">=") for req in EXTRAS.values())
    for req in _requirements(path.read_text()):
        name, sep, version = req.partition(">=")
        if sep and name.lower() in floors:
            assert version == floors[name.lower()], (
                f"{path.relative_to(ROOT)}: {req}, pyproject says {name}>={floors[name]}"
            )


def test_extras_are_pyprojects():
    """Each extra that installs one package (dev and all gather others) is EXTRAS' requirement for it."""
    extras = {name: reqs for name, reqs in _pyproject_extras().items() if name not in ("dev", "all")}
    assert extras == {name: [req] for name, req in EXTRAS.items()}


def test_a_missing_package_names_a_command_to_paste():
    reason = optional_import_reason("leantrain_no_such_module", "kernels")
    assert reason == (
        "leantrain_no_such_module not installed or not importable (ModuleNotFoundError): "
        "pip install 'liger-kernel>=0.8.5'"
    )
    assert optional_import_reason("json", "bnb") is None
    assert install_command("bnb") == "pip install 'bitsandbytes>=0.50.2'"
    with pytest.raises(ValueError, match="not one of leantrain's extras"):
        install_command("kernel")
