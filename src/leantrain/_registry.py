"""The optimization interface and its registry. Each optimization registers itself where it is defined."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._patching import RuntimeFallback, Undo
from .config import OPTIMIZATIONS, ResolvedConfig


TRAINER_KINDS = ("sft", "grpo", "trainer")


@dataclass(frozen=True)
class Readiness:
    """The probe's answer: ready when there are no reasons; ``detail`` names the path that would run."""

    reasons: tuple[str, ...] = ()
    detail: str = ""
    applicable: bool = True  # False: nothing here to optimize (no MoE layer, ...); strict mode does not raise

    @property
    def ready(self) -> bool:
        return not self.reasons

    @classmethod
    def no(cls, *reasons: str) -> Readiness:
        return cls(reasons=tuple(reasons))

    @classmethod
    def not_applicable(cls, reason: str) -> Readiness:
        return cls(reasons=(reason,), applicable=False)


@dataclass
class Applied:
    """What ``apply`` returns: the undo handle, the qualified names it patched, and the path it chose."""

    undo: Undo
    targets: tuple[str, ...] = ()
    detail: str = ""


@dataclass
class PatchContext:
    """Given to ``apply``: the resolved config, the trainer kind, this optimization's run-time fallback guard, and
    an undo stack to record patches on as they happen (if ``apply`` raises half-way, patch_trainer runs it)."""

    config: ResolvedConfig
    trainer_kind: str
    fallback: RuntimeFallback
    undo: Undo = field(default_factory=Undo)


class Optimization:
    """Subclass, set the class attributes, implement ``probe`` and ``apply``, and decorate with ``@register``."""

    name: ClassVar[str]
    trainer_kinds: ClassVar[tuple[str, ...]] = TRAINER_KINDS
    implemented: ClassVar[bool] = True
    removes_metrics: ClassVar[tuple[str, ...]] = ()
    off_by_default_why: ClassVar[str] = ""  # why an opt-in optimization is off unless asked for (the report says)

    def check_environment(self) -> tuple[str, ...]:
        """Reasons this machine cannot run the optimization at all (missing package, no device); used by `env`."""
        return ()

    def probe(self, trainer: Any, config: ResolvedConfig) -> Readiness:
        raise NotImplementedError

    def apply(self, trainer: Any, ctx: PatchContext) -> Applied:
        raise NotImplementedError


class NotAvailable(Optimization):
    """Placeholder for an optimization that this version does not ship."""

    implemented = False

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]

    def check_environment(self) -> tuple[str, ...]:
        return ("not available in this version",)

    def probe(self, trainer: Any, config: ResolvedConfig) -> Readiness:
        return Readiness.no("not available in this version")


_REGISTRY: dict[str, Optimization] = {}


def register(cls: type[Optimization]) -> type[Optimization]:
    if cls.name not in OPTIMIZATIONS:
        raise ValueError(f"{cls.name!r} is not in config.OPTIMIZATIONS")
    _REGISTRY[cls.name] = cls()
    return cls


def registry() -> dict[str, Optimization]:
    """All optimizations in apply order; importing each subpackage registers it (lazily, so imports stay cheap)."""
    for name in OPTIMIZATIONS:
        if name not in _REGISTRY:
            importlib.import_module(f"leantrain.{name}")
        _REGISTRY.setdefault(name, NotAvailable(name))
    return {name: _REGISTRY[name] for name in OPTIMIZATIONS}


def optional_import_reason(module: str, extra: str) -> str | None:
    """None if ``module`` imports, else a reason naming the pip extra."""
    try:
        importlib.import_module(module)
    except Exception as error:  # ImportError, or a broken install raising something else
        return f"{module} not installed or not importable ({type(error).__name__}): pip install leantrain[{extra}]"
    return None
