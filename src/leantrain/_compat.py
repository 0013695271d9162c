"""Tested version sets as data: read by the probes where a version decides, by ``.ci/matrix.sh`` (run as a script:
``python src/leantrain/_compat.py pins NAME``) and by the generated COMPATIBILITY.md.

Standard library only, no package imports: CI reads the pins before any venv exists.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class VersionSet:
    """One tested environment: exact pins, installed into a fresh venv by CI."""

    name: str
    label: str
    pins: tuple[tuple[str, str], ...]

    def pin(self, package: str) -> str:
        return dict(self.pins)[package]

    def requirements(self) -> list[str]:
        return [f"{package}=={version}" for package, version in self.pins]


def _set(name: str, label: str, **pins: str) -> VersionSet:
    common = {"torch": "2.13.0", "bitsandbytes": "0.50.2"}  # the local CPU torch wheel; bnb is not what varies
    return VersionSet(name, label, tuple({**common, **pins}.items()))


# Oldest first. "latest" is what the README's test command resolves today (the full suite runs on it); the floors
# run the CPU parity tests in their own venvs (.ci/matrix.sh). pyproject's lower bounds are the first set's pins.
TESTED_SETS: tuple[VersionSet, ...] = (
    _set(
        "trl-0.29",
        "TRL 0.29 (last 0.x) + transformers 4.57",
        transformers="4.57.6",
        trl="0.29.1",
        peft="0.18.1",
        accelerate="1.12.0",
        datasets="4.4.2",
    ),
    _set(
        "trl-1.14",
        "TRL 1.14 (last release before the fused LM head) + transformers 5.20",
        transformers="5.20.2",
        trl="1.14.2",
        peft="0.20.0",
        accelerate="1.14.0",
        datasets="4.8.5",
    ),
    _set(
        "latest",
        "pinned latest (README test command)",
        transformers="5.23.0",
        trl="1.16.0",
        peft="0.21.2",
        accelerate="1.15.0",
        datasets="5.2.0",
    ),
)
FLOOR = TESTED_SETS[0]
LATEST = TESTED_SETS[-1]

# Feature thresholds the probes and tests name in their reasons (first version that has the feature).
TRANSFORMERS_3D_EXPERTS = "5.0.0"  # experts as one module with 3-D gate_up_proj / down_proj stacks
TRL_FUSED_LM_HEAD = "1.15.0"  # trl.trainer.utils.add_fused_lm_head: GRPO scores log-probs from hidden states
# transformers.modeling_utils.slice_logits_to_keep with 2-D (per-row) indices: in 5.21.1, not in 5.20.2
TRANSFORMERS_ROW_LOGITS_TO_KEEP = "5.21.0"


def version_tuple(version: str) -> tuple[int, ...]:
    """'5.0.0.dev0' -> (5, 0, 0); enough for ordering the releases named here."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() < len(piece):  # '14rc1': a pre-release ends the comparable part
            break
    return tuple(parts)


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def at_least(package: str, version: str) -> bool:
    have = installed(package)
    return have is not None and version_tuple(have) >= version_tuple(version)


def needs(package: str, version: str, feature: str) -> str | None:
    """None when ``package >= version`` is installed, else the reason naming the version and the next step."""
    have = installed(package)
    if have is not None and version_tuple(have) >= version_tuple(version):
        return None
    return (
        f"needs {package} >= {version} for {feature}; installed {have or 'none'}: "
        f"pip install -U '{package}>={version}'"
    )


def untested(packages: tuple[str, ...] = ("transformers", "trl", "peft", "accelerate")) -> list[str]:
    """Installed versions outside the tested range (older than the floor or newer than the latest set)."""
    notes = []
    for package in packages:
        have = installed(package)
        if have is None:
            continue
        low, high = FLOOR.pin(package), LATEST.pin(package)
        if not version_tuple(low) <= version_tuple(have) <= version_tuple(high):
            notes.append(f"{package} {have} is outside the tested range {low} .. {high}")
    return notes


def current_set() -> VersionSet | None:
    """The tested set whose pins match what is installed (torch's local tag ignored), or None."""
    for candidate in TESTED_SETS:
        if all((installed(p) or "").split("+")[0] == v for p, v in candidate.pins if p not in ("datasets",)):
            return candidate
    return None


def _main(argv: list[str]) -> int:
    usage = "usage: _compat.py names | pins NAME"
    if argv == ["names"]:
        print(" ".join(s.name for s in TESTED_SETS))
        return 0
    if len(argv) == 2 and argv[0] == "pins":
        by_name = {s.name: s for s in TESTED_SETS}
        if argv[1] not in by_name:
            print(f"unknown set {argv[1]!r}; known: {', '.join(by_name)}", file=sys.stderr)
            return 2
        print(" ".join(by_name[argv[1]].requirements()))
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
