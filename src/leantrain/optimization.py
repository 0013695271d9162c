"""The optimization interface and its registry: probe -> plan -> apply, every change on one undo.

An optimization is a subclass of :class:`Optimization` registered by name with ``@register``. ``patch_trainer``
(the entry point) gives each one a :class:`PatchContext` (the resolved options, the trainer kind, its run-time
fallback guard and the undo stack), asks ``probe(trainer, ctx)`` for a :class:`Readiness` that carries the **plan**
(the targets found, the path chosen), and hands that plan to ``apply(trainer, plan, ctx)``, which records every
change on ``ctx.undo``. If ``apply`` raises half-way, the entry point runs ``ctx.undo``: no optimization rolls back by
hand. What an optimization does to saved weights is declared here too (:attr:`Optimization.saved_weights`,
:meth:`Optimization.export_state_dict`), so one place owns the state-dict keys it changes.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .config import OPTIMIZATIONS, ResolvedConfig
from .fallback import RuntimeFallback
from .undo import Undo


TRAINER_KINDS = ("sft", "grpo", "trainer")


@dataclass(frozen=True)
class Readiness:
    """The probe's answer, in two parts the entry point weighs together (the probe never reads its own toggle):

    - ``reasons``, the blockers: what stops leantrain's path from running here (empty: it can run, and ``plan`` is
      what ``apply`` executes, ``detail`` the path that would run). ``applicable=False``: nothing here to optimize
      (no MoE layer, no LM head, ...);
    - ``slower_evidence``, the auto rule: why auto mode would not apply it here even if nothing blocked it
      (measured slower, or not measured faster, on this device class and shape); empty: auto mode applies it.

    A probe that finds blockers still evaluates its auto rule where it can (``with_auto_rule``), so that strict mode
    fails only for an optimization asked for (``<name>=True``: the blockers) or due here on its own (auto mode would
    apply it but something blocks it), never for one auto mode would skip anyway."""

    reasons: tuple[str, ...] = ()
    detail: str = ""
    applicable: bool = True  # False: nothing here to optimize; strict mode does not raise
    plan: Any = None
    slower_evidence: str = ""  # the auto rule: why auto mode skips it here (measured slower, not measured faster)

    @property
    def blocked(self) -> bool:
        """Whether something stops it from running here (``<name>=True`` raises with the reasons)."""
        return bool(self.reasons)

    @property
    def due(self) -> bool:
        """Whether auto mode would apply it here if nothing blocked it (strict mode raises on a blocked one only)."""
        return self.applicable and not self.slower_evidence

    @property
    def ready(self) -> bool:
        """Whether auto mode applies it: nothing blocks it and the auto rule does not skip it."""
        return not self.blocked and self.due

    @classmethod
    def slower(cls, evidence: str, detail: str = "", plan: Any = None) -> Readiness:
        """Nothing blocks it, but it is measured slower (or not measured faster) than the stock path here: auto mode
        skips it with ``evidence``, ``<name>=True`` applies ``plan``. Strict mode does not raise on the skip (it is a
        choice, not a failure)."""
        return cls(detail=detail, plan=plan, slower_evidence=evidence)

    @classmethod
    def no(cls, *reasons: str) -> Readiness:
        return cls(reasons=tuple(reasons))

    @classmethod
    def not_applicable(cls, reason: str) -> Readiness:
        return cls(reasons=(reason,), applicable=False)

    def with_auto_rule(self, evidence: str | None) -> Readiness:
        """This answer with the auto rule's verdict: ``evidence`` why auto mode would not apply it here (None or "":
        auto mode would apply it)."""
        return dataclasses.replace(self, slower_evidence=evidence or "")


@dataclass(frozen=True)
class Applied:
    """What ``apply`` returns for the report: the qualified names it patched and the path it chose."""

    targets: tuple[str, ...] = ()
    detail: str = ""


@dataclass
class PatchContext:
    """Given to ``probe`` and ``apply``: the resolved options, the trainer kind, this optimization's run-time
    fallback guard, the undo stack every change is recorded on (the only undo), and the optimizations before this
    one in registry order that will apply (every probe runs before any apply: what a probe may count on)."""

    config: ResolvedConfig
    trainer_kind: str
    fallback: RuntimeFallback
    undo: Undo = field(default_factory=Undo)
    applying: tuple[str, ...] = ()


class Optimization:
    """Subclass, set the class attributes, implement ``probe`` and ``apply``, and decorate with ``@register``."""

    name: ClassVar[str]
    trainer_kinds: ClassVar[tuple[str, ...]] = TRAINER_KINDS
    implemented: ClassVar[bool] = True
    removes_metrics: ClassVar[tuple[str, ...]] = ()
    off_by_default_why: ClassVar[str] = ""  # why an opt-in optimization is off unless asked for (the report says)
    # What save_model() writes for what this optimization changed; export_state_dict() implements any change.
    saved_weights: ClassVar[str] = "unchanged: the optimization patches code, not weights"

    def check_environment(self) -> tuple[str, ...]:
        """Reasons this machine cannot run the optimization at all (missing package, no device); used by `env`."""
        return ()

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        """Decide readiness and find the plan; change nothing."""
        raise NotImplementedError

    def breaks_when_off(self, trainer: Any) -> str | None:
        """Why the stock path cannot train this trainer, where turning the optimization off asks for it (then
        ``<name>=False`` is an error at patch time, not a failure some steps in); None where stock trains."""
        return None

    def apply(self, trainer: Any, plan: Any, ctx: PatchContext) -> Applied:
        """Execute the probe's plan, recording every change on ``ctx.undo``."""
        raise NotImplementedError

    def export_state_dict(self, trainer: Any, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        """The state dict a user export (``trainer.save_model()``) writes; None keeps it as it is. Checkpoints that
        ``train()`` writes always keep the live state, so training resumes exactly."""
        return None


class NotAvailable(Optimization):
    """Placeholder for an optimization that this version does not ship."""

    implemented = False

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]

    def check_environment(self) -> tuple[str, ...]:
        return ("not available in this version",)

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
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


# pyproject.toml's optional extras, each as the requirement it installs (tests/unit/test_install_commands.py keeps
# them equal). leantrain installs from its repository, not from PyPI, so a reason that tells a user what to install
# names the package itself: an install command naming leantrain's extras would look for leantrain on PyPI.
EXTRAS = {
    "bnb": "bitsandbytes>=0.50.2",
    "cce": "cut-cross-entropy>=25.1.1",
    "deepspeed": "deepspeed>=0.19.8",
    "kernels": "liger-kernel>=0.8.5",
}


def install_command(extra: str) -> str:
    """The command that installs what a pyproject extra installs, to paste from a reason."""
    if extra not in EXTRAS:
        raise ValueError(f"{extra!r} is not one of leantrain's extras: {', '.join(EXTRAS)}")
    return f"pip install '{EXTRAS[extra]}'"


def optional_import_reason(module: str, extra: str) -> str | None:
    """None if ``module`` imports, else a reason naming the command that installs the extra's package."""
    try:
        importlib.import_module(module)
    except Exception as error:  # ImportError, or a broken install raising something else
        return f"{module} not installed or not importable ({type(error).__name__}): {install_command(extra)}"
    return None
