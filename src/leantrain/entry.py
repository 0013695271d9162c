"""The one entry point: detect the trainer kind, resolve the config, probe, apply, report; and its undo."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .config import OPTIMIZATIONS, ResolvedConfig, as_typed, resolve_config
from .fallback import RuntimeFallback
from .optimization import Applied, Optimization, PatchContext, Readiness, registry
from .report import PatchOutcome, PatchReport, Status
from .undo import Undo


logger = logging.getLogger("leantrain")
_STATE_ATTR = "_leantrain_state"


class NotReadyError(RuntimeError):
    """An optimization was required (``True``) or strict mode is on, and its probe declined."""


@dataclass
class _State:
    undo: Undo
    report: PatchReport
    fallbacks: dict[str, RuntimeFallback]


# TRL trainers, recognised by class name along the trainer's MRO: deciding imports no trainer module (TRL's GRPO
# module needs `requests` in some releases; an SFT run must not depend on it importing).
TRL_KINDS = (("grpo", ("GRPOTrainer", "RLOOTrainer")), ("sft", ("SFTTrainer",)))


def trainer_kind(trainer: Any) -> str:
    """'grpo' (GRPOTrainer, RLOOTrainer), 'sft' (SFTTrainer) or 'trainer' (transformers.Trainer); else TypeError.

    Imports nothing: a Trainer's module is in ``sys.modules`` already, and TRL classes are read off the MRO."""
    _check_trainer(trainer, "patch_trainer")
    trl_classes = [c.__name__ for c in type(trainer).__mro__ if c.__module__.partition(".")[0] == "trl"]
    for kind, names in TRL_KINDS:
        if any(name in names for name in trl_classes):
            return kind
    if trl_classes:
        raise TypeError(
            f"unsupported trainer {type(trainer).__name__} (a {trl_classes[0]}): leantrain supports SFTTrainer, "
            "GRPOTrainer, RLOOTrainer and a plain transformers Trainer"
        )
    return "trainer"


def _check_trainer(trainer: Any, caller: str) -> None:
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None or not isinstance(trainer, trainer_module.Trainer):
        raise TypeError(f"{caller}() needs a transformers.Trainer or a TRL trainer, got {type(trainer).__name__}")


def _failed_import(error: BaseException) -> ImportError | None:
    """The ImportError behind ``error``: transformers' and TRL's lazy modules re-raise it as a RuntimeError."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ImportError):
            return seen
        seen = seen.__cause__
    return None


def _probe(opt: Optimization, trainer: Any, ctx: PatchContext) -> Readiness:
    """The optimization's probe; an optional import that fails inside it declines with the reason instead of
    escaping ``patch_trainer`` (a required optimization then raises NotReadyError with it)."""
    try:
        return opt.probe(trainer, ctx)
    except Exception as error:
        missing = _failed_import(error)
        if missing is None:
            raise
        return Readiness.no(f"an import it needs failed ({type(missing).__name__}: {missing})")


# Where a setting came from, lowest first: an explicit request (in code, on the command line) overrides a kill switch
# set lower down; the switch beats every environment toggle.
_RANK = {"default": 0, "kept": 0, "env": 1, "cli": 2, "kwarg": 3}


def _kill_switch(opt: Optimization, cfg: ResolvedConfig) -> tuple[str, ...] | None:
    """The kill switch (``disable`` / ``LEANTRAIN_DISABLE=1``) turns every optimization off, environment toggles
    included; only an explicit request for an optimization (``cggr=True`` in code, ``--cggr`` on the command line)
    from a source above the switch's overrides it (the same source twice is a contradiction, raised by the config).
    Returns the DISABLED reason, or None when the switch is off or overridden."""
    if not cfg.config.disable:
        return None
    switch_source = cfg.sources["disable"]
    switch = as_typed("disable", True, switch_source)
    wanted, source = getattr(cfg.config, opt.name), cfg.sources[opt.name]
    if wanted is True and source in ("kwarg", "cli") and _RANK[source] > _RANK[switch_source]:
        return None
    if wanted is False or source == "default":
        return (f"{switch} (the kill switch)",)
    explicit = {"kwarg": f"{opt.name}=True in code", "cli": f"{as_typed(opt.name, True, 'cli')} on the command line"}
    above = [text for s, text in explicit.items() if _RANK[s] > _RANK[switch_source]]
    only = f"; only {' or '.join(above)} overrides the switch" if above else ""
    return (f"{switch} (the kill switch) overrides {as_typed(opt.name, wanted, source)}{only}",)


def _decide(
    opt: Optimization, trainer: Any, ctx: PatchContext
) -> tuple[Status | None, str, tuple[str, ...], Readiness | None]:
    """Return (final status or None to apply, source, reasons, readiness)."""
    cfg = ctx.config
    wanted: bool | None = getattr(cfg.config, opt.name)
    source = cfg.sources[opt.name]
    killed = _kill_switch(opt, cfg)
    if killed:
        return Status.DISABLED, cfg.sources["disable"], killed, None
    if wanted is False:
        broken = opt.breaks_when_off(trainer) if source != "default" else None
        if broken:
            typed = as_typed(opt.name, False, source)
            raise ValueError(f"{typed} asks for the stock path, which cannot train here: {broken}")
        why = f"off by default: {opt.off_by_default_why}" if opt.off_by_default_why else "off by default"
        return Status.DISABLED, source, ("turned off" if source != "default" else f"{why}; pass True",), None
    if not opt.implemented:
        return Status.SKIPPED, source, ("not available in this version",), None
    if ctx.trainer_kind not in opt.trainer_kinds:
        kinds = "plain Trainers" if ctx.trainer_kind == "trainer" else f"{ctx.trainer_kind} trainers"
        return Status.SKIPPED, source, (f"does not apply to {kinds}",), None
    readiness = _probe(opt, trainer, ctx)
    if wanted is True:  # on request: the blockers alone decide (the auto rule is quoted in the detail)
        return (Status.SKIPPED if readiness.blocked else None), source, readiness.reasons, readiness
    # auto: nothing to optimize, then the auto rule, then the blockers (strict mode raises on those only)
    if readiness.applicable and readiness.slower_evidence:
        return Status.SKIPPED, source, skipped_by_rule(opt.name, readiness), readiness
    if readiness.blocked:
        return Status.SKIPPED, source, readiness.reasons, readiness
    return None, source, (), readiness


# The one wording of the auto rule: a path measured slower (or not measured faster) here is skipped in auto mode,
# applied on request.
def skipped_as_slower(name: str, evidence: str) -> str:
    return f"{evidence}; pass {name}=True to apply anyway"


def skipped_by_rule(name: str, readiness: Readiness) -> tuple[str, ...]:
    """Auto mode's skip reason where the auto rule decides: the evidence, and what would stop ``<name>=True`` too
    (then passing it would not help, and the reason says so instead)."""
    if not readiness.blocked:
        return (skipped_as_slower(name, readiness.slower_evidence),)
    return (f"{readiness.slower_evidence}; {name}=True would not apply either: " + "; ".join(readiness.reasons),)


def applied_on_request(name: str, evidence: str) -> str:
    return f"applied on request ({name}=True); {evidence}"


# The options of the innermost `leantrain run` in progress: (the `cli` layer, the `kept` layer) of every patch_trainer
# call in it.
_COMMAND_LINE: list[tuple[dict[str, Any], dict[str, Any]]] = []


@contextlib.contextmanager
def command_line(options: Mapping[str, Any], kept: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Within the block, every ``patch_trainer`` call resolves ``options`` as the command line's (source ``cli``):
    below its own keywords, above ``LEANTRAIN_*``; and ``kept`` (what ``leantrain compare --keep`` kept for this
    target, source ``kept``) below ``LEANTRAIN_*``. ``leantrain run`` holds it for the target's whole run."""
    _COMMAND_LINE.append((dict(options), dict(kept or {})))
    try:
        yield
    finally:
        _COMMAND_LINE.pop()


def patch_trainer(
    trainer: Any,
    *,
    moe4bit: bool | None = None,
    osft: bool | None = None,
    layer_kernels: bool | None = None,
    compile_layers: bool | None = None,
    fused_ce: bool | None = None,
    cggr: bool | None = None,
    grpo_logps: bool | None = None,
    compile_generation: bool | None = None,
    offload_checkpoints: bool | None = None,
    padding_free: bool | None = None,
    strict: bool | None = None,
    environ: Mapping[str, str] | None = None,
    **options: Any,
) -> PatchReport:
    """Apply every optimization whose probe passes; return the report (also at ``trainer.leantrain_report``).

    Each toggle (one per optimization in ``config.OPTIMIZATIONS``, in apply order; a test keeps this signature in
    step with it) is None (auto: skipped where its probe declines or measured it slower), True (required: applied
    even where measured slower; raise if not ready) or False (off). ``options`` are the fields of
    :class:`leantrain.config.LeantrainConfig`. They resolve above ``leantrain run``'s command line, which resolves
    above ``LEANTRAIN_*`` variables, then defaults. Patching an already patched trainer changes nothing; a
    request that contradicts what is applied raises ValueError (unpatch first).
    """
    given = locals()
    toggles = {name: given[name] for name in (*OPTIMIZATIONS, "strict") if name in given}
    keywords = {**{k: v for k, v in toggles.items() if v is not None}, **options}
    cli, kept = _COMMAND_LINE[-1] if _COMMAND_LINE else (None, None)
    cfg = resolve_config(keywords, environ, cli, kept)
    kind = trainer_kind(trainer)
    state: _State | None = getattr(trainer, _STATE_ATTR, None)
    if state is not None:
        _check_same_request(state.report, cfg)
        report = state.report.with_note("patch_trainer called again: already patched, nothing changed")
        _set_report(trainer, report)
        return report

    undo = Undo()
    outcomes: list[PatchOutcome] = []
    fallbacks: dict[str, RuntimeFallback] = {}
    plan: list[tuple[Optimization, str, PatchContext, Readiness | None]] = []
    for opt in registry().values():
        fallback = RuntimeFallback(opt.name, cfg.config.strict, _recorder(trainer, opt.name))
        ctx = PatchContext(cfg, kind, fallback, applying=tuple(o.name for o, *_ in plan))
        status, source, reasons, readiness = _decide(opt, trainer, ctx)
        required = getattr(cfg.config, opt.name) is True
        # strict: an optimization auto mode would apply here but something blocks (not one the auto rule skips)
        strict_miss = cfg.config.strict and readiness is not None and readiness.due
        if status is Status.SKIPPED and (required or strict_miss):
            why = "is required but not ready" if required else "applies here but is not ready (strict mode)"
            raise NotReadyError(f"{opt.name} {why}: " + "; ".join(reasons))
        if status is not None:
            outcomes.append(PatchOutcome(opt.name, status, source, reasons))
        else:
            fallbacks[opt.name] = fallback
            plan.append((opt, source, ctx, readiness))
            outcomes.append(PatchOutcome(opt.name, Status.APPLIED, source))

    report = PatchReport(kind, tuple(outcomes))
    if cfg.config.disable and plan:
        by = [
            f"{as_typed(opt.name, True, src)} {'in code' if src == 'kwarg' else 'on the command line'}"
            for opt, src, *_ in plan
        ]
        report = report.with_note(f"the kill switch is on, but {', '.join(by)} overrides it")
    state = _State(undo, report, fallbacks)
    setattr(trainer, _STATE_ATTR, state)
    try:
        for opt, source, ctx, readiness in plan:
            try:
                applied: Applied = opt.apply(trainer, readiness.plan if readiness is not None else None, ctx)
            finally:
                undo.extend(ctx.undo)  # on failure: rolled back below with everything applied before it
            detail = applied.detail
            if readiness is not None and readiness.slower_evidence:
                detail = f"{detail}; {applied_on_request(opt.name, readiness.slower_evidence)}".lstrip("; ")
            state.report = state.report.with_outcome(
                PatchOutcome(opt.name, Status.APPLIED, source, (), applied.targets, detail)
            )
        applied_opts = [opt for opt, *_ in plan]
        # Kept with the run: leantrain.json beside saved weights, the statuses in the trackers' run config.
        from . import _record  # lazy: transformers' callback stack is heavy to import

        _record.install_exports(trainer, applied_opts, undo)
        _record.install(trainer, cfg, lambda: current_report(trainer), undo)
    except BaseException:
        undo()
        trainer.__dict__.pop(_STATE_ATTR, None)
        raise
    for opt in registry().values():
        if opt.name in state.report.applied and opt.removes_metrics and kind != "trainer":  # TRL's metrics
            state.report = state.report.with_note(f"{opt.name}: {', '.join(opt.removes_metrics)}")
    _set_report(trainer, state.report)
    if _is_main_process(trainer):
        logger.info(state.report.summary())
    return state.report


def _check_same_request(report: PatchReport, cfg: ResolvedConfig) -> None:
    """A second ``patch_trainer`` call on a patched trainer changes nothing, so a request it could not honour is an
    error, not a silent no-op: ``<name>=True`` for an optimization that is not applied, ``<name>=False`` for one that
    is. Unpatch first to patch with another request."""
    contradictions = []
    for name in (o.name for o in report.outcomes):
        wanted, source = getattr(cfg.config, name, None), cfg.sources.get(name)
        if source not in ("kwarg", "cli") or wanted is None:
            continue
        if (wanted is True) != (name in report.applied):
            state = "applied" if name in report.applied else "not applied"
            contradictions.append(f"{as_typed(name, wanted, source)} but {name} is {state}")
    if contradictions:
        raise ValueError(
            "patch_trainer() called again on a patched trainer with another request ("
            + "; ".join(contradictions)
            + "): call leantrain.unpatch_trainer(trainer) first, then patch_trainer with the new request"
        )


def _recorder(trainer: Any, name: str):
    def record(reason: str) -> None:
        state: _State | None = getattr(trainer, _STATE_ATTR, None)
        if state is None:
            return
        old = state.report[name]
        state.report = state.report.with_outcome(
            PatchOutcome(name, Status.FAILED, old.source, (f"run-time fallback to stock: {reason}",), old.targets)
        )
        _set_report(trainer, state.report)

    return record


def _set_report(trainer: Any, report: PatchReport) -> None:
    trainer.__dict__["leantrain_report"] = report
    state = getattr(trainer, _STATE_ATTR, None)
    if state is not None:
        state.report = report


def _is_main_process(trainer: Any) -> bool:
    check = getattr(trainer, "is_world_process_zero", None)
    return bool(check()) if callable(check) else True


def current_report(trainer: Any) -> PatchReport | None:
    """The trainer's report as it stands now (run-time fallbacks included), or None if not patched."""
    state: _State | None = getattr(trainer, _STATE_ATTR, None)
    return None if state is None else state.report


def unpatch_trainer(trainer: Any) -> None:
    """Undo every patch in reverse order, restoring the original methods and modules by identity."""
    _check_trainer(trainer, "unpatch_trainer")
    state: _State | None = trainer.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    state.undo()
    trainer.__dict__.pop("leantrain_report", None)


@contextlib.contextmanager
def patched(trainer: Any, **kwargs: Any) -> Iterator[PatchReport]:
    """``with leantrain.patched(trainer) as report: trainer.train()``; unpatches on exit."""
    report = patch_trainer(trainer, **kwargs)
    try:
        yield report
    finally:
        unpatch_trainer(trainer)
