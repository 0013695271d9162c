"""The fused log-probs' probe: which TRL path (its fused LM head, or the older log-prob method), which models (the
policy's base, the reference model), each head's settings: the plan ``apply`` executes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..lm_head import ops
from ..models import is_peft_model, unwrap_model
from ..optimization import PatchContext, Readiness
from . import patch as glue


def policy_base(trainer: Any) -> nn.Module:
    """The model instance TRL patched: the PEFT base model, else the model itself."""
    model = trainer.model
    return model.get_base_model() if is_peft_model(model) else unwrap_model(model)


def targets_of(trainer: Any) -> list[tuple[str, nn.Module]]:
    targets = [("model", policy_base(trainer))]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        targets.append(("ref_model", unwrap_model(ref)))
    return targets


def kernel_name() -> str:
    has_cuda = torch.cuda.is_available()
    return "triton" if has_cuda and ops.triton_available() else "torch chunked"


@dataclass
class LogpsPlan:
    """The probe's plan: the TRL path ('fused' head or 'legacy' method) and each model's head settings."""

    path: str
    targets: list[tuple[str, nn.Module, glue.HeadSettings]]


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    path = path_of(trainer)
    if path not in ("fused", "legacy"):
        return Readiness.no(path)
    reasons: list[str] = []
    plan = LogpsPlan(path, [])
    for label, model in targets_of(trainer):
        reasons += [f"{label}: {r}" for r in glue.head_reasons(model)]
        if path == "fused":
            settings = glue.trl_head_settings(model)
            if isinstance(settings, str):
                reasons.append(f"{label}: {settings}")
                continue
            extra = [o for o in settings.outputs if o not in glue.FUSED_OUTPUTS]
            if extra:
                reasons.append(f"{label}: TRL asks the fused head for {', '.join(extra)}, which leantrain lacks")
        else:
            settings = glue.legacy_settings(trainer, model)
            if label == "ref_model":
                settings.outputs = ("log_probs",)
        scaling = glue.scaling_reason(settings, model.config)
        if scaling:
            reasons.append(f"{label}: {scaling}")
        plan.targets.append((label, model, settings))
    if reasons:
        return Readiness.no(*reasons)
    return Readiness(detail=detail(trainer, path), plan=plan)


def path_of(trainer: Any) -> str:
    """'fused' (TRL >= 1.15 fused LM head), 'legacy' (older method) or a reason."""
    if glue.trl_fused_forward(policy_base(trainer)) is not None:
        return "fused"
    kind = glue.legacy_method_kind(trainer)
    if isinstance(kind, str):
        return kind
    try:
        from trl.trainer import utils as trl_utils
    except ImportError:
        trl_utils = None
    if trl_utils is not None and hasattr(trl_utils, "add_fused_lm_head"):
        return "TRL has add_fused_lm_head but the policy's forward is not its fused head: TRL not recognised"
    return glue.legacy_reason(trainer) or "legacy"


def detail(trainer: Any, path: str) -> str:
    where = "policy" + (" + ref model" if getattr(trainer, "ref_model", None) is not None else "")
    if path == "fused":
        how = "TRL >= 1.15 fused LM head (add_fused_lm_head forward) wrapped"
    else:
        n = glue.legacy_method_kind(trainer)
        how = f"TRL <= 1.14 {glue.legacy_method_name(trainer)} ({n}-tuple) replaced"
    # the no-grad dispatch to TRL's own head: fused path only (the rule compares with that head)
    nograd = glue.nograd_detail(targets_of(trainer)) if path == "fused" else ""
    return f"{how} on {where}; kernel: {kernel_name()}" + (f"; {nograd}" if nograd else "")
