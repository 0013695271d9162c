"""The fused log-probs' probe: which TRL path (its fused LM head, or the older log-prob method), which models (the
policy's base, the reference model), each head's settings as TRL reads them, the method to replace on older TRL and
the report's words: the plan, so that ``apply`` searches nothing again."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import trl_head
from ..lm_head import ops
from ..models import head_weight_reasons, is_peft_model, logit_transform, unwrap_model
from ..optimization import PatchContext, Readiness
from ..trl_head import HeadSettings
from . import measured, nograd


FUSED_OUTPUTS = ("log_probs", "entropy")  # what the fused forward (patch.py) computes
_LEGACY_PARAMS = ("input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy")  # text-only calls


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


# ------------------------------------------------------------------------- TRL >= 1.15: its fused LM head
def trl_fused_forward(model: nn.Module) -> Callable[..., Any] | None:
    """TRL's ``_fused_forward`` function under this instance's ``forward`` (possibly inside accelerate's autocast /
    fp32-output wrappers, as on a prepared reference model), or None."""
    return trl_head.fused_forward_of(model)


def trl_head_settings(model: nn.Module) -> HeadSettings | str:
    """Read TRL's fused-head settings from its forward closure; a reason string when not recognised."""
    return trl_head.fused_settings(model)


# ----------------------------------------------------------------------- TRL <= 1.14: the full-logits method
def legacy_method_name(trainer: Any) -> str:
    """The full-logits method to replace: GRPO 1.14 dispatches ``_get_per_token_logps_and_entropies`` (a
    ``*args`` wrapper) to ``_full_logits_logps``; earlier TRL and RLOO compute in the method itself."""
    return "_full_logits_logps" if hasattr(trainer, "_full_logits_logps") else "_get_per_token_logps_and_entropies"


def legacy_method_kind(trainer: Any) -> int | str:
    """2 or 3 (values returned by the old full-logits method), or a reason string."""
    name = legacy_method_name(trainer)
    method = getattr(trainer, name, None)
    if method is None:
        return "the trainer has neither TRL's fused LM head nor _get_per_token_logps_and_entropies: TRL not recognised"
    params = inspect.signature(method).parameters
    if not all(n in params for n in _LEGACY_PARAMS):
        return f"{name} has an unknown signature: TRL version not recognised"
    return 3 if "compute_aux_loss" in params else 2


def legacy_reason(trainer: Any) -> str | None:
    """Why the TRL <= 1.14 path cannot serve this trainer, or None."""
    if getattr(trainer, "use_liger_kernel", False):
        return (
            "use_liger_kernel=True: this TRL computes the GRPO loss (and in 1.14 the log-probs) with Liger's own "
            "fused kernel, not the full-logits method leantrain replaces; set use_liger_kernel=False or upgrade "
            "to trl >= 1.15"
        )
    return None


def legacy_settings(trainer: Any, base: nn.Module) -> HeadSettings:
    text = base.config.get_text_config()
    scale, softcap = logit_transform(base.config)
    return HeadSettings(
        temperature=float(trainer.temperature),
        outputs=FUSED_OUTPUTS,
        cast_lm_head_to_fp32=bool(getattr(getattr(trainer, "args", None), "cast_lm_head_to_fp32", False)),
        logit_scale=scale,
        softcap=softcap,
        backbone_attr="base_model",
        text_config=text,
    )


# ---------------------------------------------------------------------------------- readiness and the plan
def scaling_reason(settings: HeadSettings, config: Any) -> str | None:
    """Decline when TRL's scaling and leantrain's model adapter disagree (unknown output scaling)."""
    return trl_head.scaling_reason(settings, config)


def head_reasons(model: nn.Module) -> list[str]:
    head = model.get_output_embeddings()
    reasons = []
    if head is None:
        return [f"{type(model).__name__} has no output embeddings (LM head)"]
    if getattr(head, "bias", None) is not None:
        reasons.append("the LM head has a bias: leantrain's fused op has no bias term; TRL's head runs")
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        reasons.append("the LM head carries a PEFT adapter: remove 'lm_head' from target_modules")
        return reasons
    return reasons + [f"{r}: TRL's head runs" for r in head_weight_reasons(getattr(head, "weight", None))]


@dataclass(frozen=True)
class LegacyMethod:
    """TRL <= 1.14's full-logits method that ``apply`` replaces, and how many values it returns (2 or 3)."""

    name: str
    n_values: int


@dataclass
class LogpsPlan:
    """The probe's plan, all that ``apply`` needs: the TRL path ('fused' head or 'legacy' method), each model's head
    settings, the method to replace on the legacy path, and the report's detail."""

    path: str
    targets: list[tuple[str, nn.Module, HeadSettings]]
    legacy: LegacyMethod | None = None
    detail: str = ""

    @property
    def guards_forwards(self) -> bool:
        """Where the run-time fallback sits: around each wrapped forward on TRL's fused path. On the legacy path the
        model's own forward knows no ``fused_lm_head``: it sits one level up, around the whole replaced method, whose
        stock version computes full logits."""
        return self.legacy is None


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    # the auto rule: measured on CUDA only (grpo_logps=True applies it anyway); strict mode weighs it with the blockers
    rule = measured.device_reason(trainer.args.device.type)
    path = path_of(trainer)
    if path not in ("fused", "legacy"):
        return Readiness.no(path).with_auto_rule(rule)
    reasons: list[str] = []
    plan = LogpsPlan(path, [])
    for label, model in targets_of(trainer):
        reasons += [f"{label}: {r}" for r in head_reasons(model)]
        if path == "fused":
            settings = trl_head_settings(model)
            if isinstance(settings, str):
                reasons.append(f"{label}: {settings}")
                continue
            extra = trl_head.outputs_reason(settings, FUSED_OUTPUTS)
            if extra:
                reasons.append(f"{label}: {extra}")
        else:
            settings = legacy_settings(trainer, model)
            if label == "ref_model":
                settings = dataclasses.replace(settings, outputs=("log_probs",))
        scaling = scaling_reason(settings, model.config)
        if scaling:
            reasons.append(f"{label}: {scaling}")
        plan.targets.append((label, model, settings))
    if reasons:
        return Readiness.no(*reasons).with_auto_rule(rule)
    if path == "legacy":
        plan.legacy = LegacyMethod(legacy_method_name(trainer), legacy_method_kind(trainer))
    plan.detail = detail(trainer, plan)
    return Readiness(detail=plan.detail, plan=plan).with_auto_rule(rule)


def path_of(trainer: Any) -> str:
    """'fused' (TRL >= 1.15 fused LM head), 'legacy' (older method) or a reason."""
    if trl_fused_forward(policy_base(trainer)) is not None:
        return "fused"
    kind = legacy_method_kind(trainer)
    if isinstance(kind, str):
        return kind
    if trl_head.trl_has_fused_head():
        return "TRL has add_fused_lm_head but the policy's forward is not its fused head: TRL not recognised"
    return legacy_reason(trainer) or "legacy"


def detail(trainer: Any, plan: LogpsPlan) -> str:
    where = "policy" + (" + ref model" if getattr(trainer, "ref_model", None) is not None else "")
    if plan.legacy is None:
        how = "TRL >= 1.15 fused LM head (add_fused_lm_head forward) wrapped"
        words = nograd_detail([(label, model) for label, model, _ in plan.targets])
    else:
        how = f"TRL <= 1.14 {plan.legacy.name} ({plan.legacy.n_values}-tuple) replaced"
        words = ""  # the no-grad rule compares with TRL's fused head, which this TRL lacks
    return f"{how} on {where}; kernel: {kernel_name()}" + (f"; {words}" if words else "")


def nograd_detail(heads: list[tuple[str, nn.Module]]) -> str:
    """The report's words for the no-grad dispatch: which (label, model) heads' no-grad calls use TRL's own head."""
    parts = []
    for label, model in heads:
        found = trl_head.head_shape(model)
        if found is None or not nograd.trl_head_serves(found[1], ops.default_backend(found[0].device)):
            continue
        _, v, h = found
        parts.append(f"{'policy' if label == 'model' else label.replace('_', ' ')} H={h} V={v} (any N)")
    if not parts:
        return ""
    return f"no-grad calls at {', '.join(parts)} use TRL's own head (measured faster: {nograd.EVIDENCE})"
