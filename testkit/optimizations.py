"""patch_trainer keywords that isolate one optimization, from the one list of names (``config.OPTIMIZATIONS``): a new
optimization is off in every test that asks for another one, with no edit here or there."""

from __future__ import annotations

from leantrain.config import OPTIMIZATIONS


def others_off(name: str) -> dict[str, bool]:
    """Every optimization but ``name`` off; ``name`` is left to the caller (``moe4bit=True, **others_off(...)``)."""
    if name not in OPTIMIZATIONS:
        raise ValueError(f"{name!r} is not an optimization: {', '.join(OPTIMIZATIONS)}")
    return {other: False for other in OPTIMIZATIONS if other != name}


def only(name: str, value: bool | None = True) -> dict[str, bool | None]:
    """``name`` set to ``value`` (required by default; None for auto), every other optimization off."""
    return {**others_off(name), name: value}
