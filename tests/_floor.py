"""The skip reason of tests that need the oldest tested set (transformers 4.x model classes): it says what to install
to run them. (A helper module: a test module is never imported as one.)"""

from __future__ import annotations

from leantrain._compat import FLOOR, TRANSFORMERS_3D_EXPERTS, installed, version_tuple


VARYING = ("transformers", "trl", "peft", "accelerate")  # what differs between the tested sets


def floor_only(what: str) -> str | None:
    """None where the installed transformers predates 3-D experts (``what`` exists there), else the skip reason."""
    have = installed("transformers")
    if have is None or version_tuple(have) < version_tuple(TRANSFORMERS_3D_EXPERTS):
        return None
    pins = " ".join(f"'{package}=={FLOOR.pin(package)}'" for package in VARYING)
    return (
        f"transformers {have}: {what} exist in transformers < {TRANSFORMERS_3D_EXPERTS} only; to run these tests, "
        f"install leantrain's oldest tested set ({FLOOR.name}) in a separate environment: pip install {pins}"
    )
