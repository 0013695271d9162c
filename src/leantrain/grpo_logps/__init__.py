"""Fused GRPO/RLOO log-probs and entropies: no [B, T, V] logits, 2 GEMMs instead of 3 with a frozen LM head."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._patching import RuntimeFallback
from .._registry import Applied, Optimization, PatchContext, Readiness, register
from ..models import is_peft_model, unwrap_model
from . import _trl, ops
from .ops import logp_entropy


__all__ = ["GrpoLogps", "logp_entropy"]


def _policy_base(trainer: Any) -> nn.Module:
    """The model instance TRL patched: the PEFT base model, else the model itself."""
    model = trainer.model
    return model.get_base_model() if is_peft_model(model) else unwrap_model(model)


def _targets(trainer: Any) -> list[tuple[str, nn.Module]]:
    targets = [("model", _policy_base(trainer))]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        targets.append(("ref_model", unwrap_model(ref)))
    return targets


def _kernel_name() -> str:
    has_cuda = torch.cuda.is_available()
    return "triton" if has_cuda and ops.triton_available() else "torch chunked"


@dataclass
class LogpsPlan:
    """The probe's plan: the TRL path ('fused' head or 'legacy' method) and each model's head settings."""

    path: str
    targets: list[tuple[str, nn.Module, _trl.HeadSettings]]


@register
class GrpoLogps(Optimization):
    name = "grpo_logps"
    trainer_kinds = ("grpo",)

    def check_environment(self) -> tuple[str, ...]:
        try:
            import trl  # noqa: F401
        except ImportError:
            return ("trl not installed: pip install trl",)
        return ()

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        path = self._path(trainer)
        if path not in ("fused", "legacy"):
            return Readiness.no(path)
        reasons: list[str] = []
        plan = LogpsPlan(path, [])
        for label, model in _targets(trainer):
            reasons += [f"{label}: {r}" for r in _trl.head_reasons(model)]
            if path == "fused":
                settings = _trl.trl_head_settings(model)
                if isinstance(settings, str):
                    reasons.append(f"{label}: {settings}")
                    continue
                extra = [o for o in settings.outputs if o not in _trl.FUSED_OUTPUTS]
                if extra:
                    reasons.append(f"{label}: TRL asks the fused head for {', '.join(extra)}, which leantrain lacks")
            else:
                settings = _trl.legacy_settings(trainer, model)
                if label == "ref_model":
                    settings.outputs = ("log_probs",)
            scaling = _trl.scaling_reason(settings, model.config)
            if scaling:
                reasons.append(f"{label}: {scaling}")
            plan.targets.append((label, model, settings))
        if reasons:
            return Readiness.no(*reasons)
        return Readiness(detail=self._detail(trainer, path), plan=plan)

    def apply(self, trainer: Any, plan: LogpsPlan, ctx: PatchContext) -> Applied:
        undo = ctx.undo
        kernel_guard = RuntimeFallback("grpo_logps triton kernel", ctx.fallback.strict)
        run_op = functools.partial(
            _run_op, kernel_guard, ctx.config.grpo_logps_tile_mib, ctx.config.grpo_logps_keep_logits_mib
        )
        names = []
        for label, model, settings in plan.targets:
            is_policy = label == "model"
            call = _trl.FusedCall(settings, run_op, _entropy_grad(trainer) if is_policy else (lambda: False))
            # On the legacy path the model's own forward knows no `fused_lm_head`: the fallback sits one level up,
            # around the whole replaced method, whose stock version computes full logits.
            guard = ctx.fallback if plan.path == "fused" else None
            undo.wrap_method(model, "forward", functools.partial(_make_forward, model, call, guard))
            names.append(f"{label}.forward ({type(model).__name__})")
        if plan.path != "fused":
            n_values = _trl.legacy_method_kind(trainer)
            method_name = _trl.legacy_method_name(trainer)
            undo.wrap_method(
                trainer,
                method_name,
                lambda original: _guarded(ctx.fallback, _trl.legacy_method(trainer, original, n_values), original),
            )
            names.append(f"{type(trainer).__name__}.{method_name}")
        return Applied(tuple(names), self._detail(trainer, plan.path))

    @staticmethod
    def _path(trainer: Any) -> str:
        """'fused' (TRL >= 1.15 fused LM head), 'legacy' (older method) or a reason."""
        if _trl.trl_fused_forward(_policy_base(trainer)) is not None:
            return "fused"
        kind = _trl.legacy_method_kind(trainer)
        if isinstance(kind, str):
            return kind
        try:
            from trl.trainer import utils as trl_utils
        except ImportError:
            trl_utils = None
        if trl_utils is not None and hasattr(trl_utils, "add_fused_lm_head"):
            return "TRL has add_fused_lm_head but the policy's forward is not its fused head: TRL not recognised"
        return _trl.legacy_reason(trainer) or "legacy"

    @staticmethod
    def _detail(trainer: Any, path: str) -> str:
        where = "policy" + (" + ref model" if getattr(trainer, "ref_model", None) is not None else "")
        if path == "fused":
            how = "TRL >= 1.15 fused LM head (add_fused_lm_head forward) wrapped"
        else:
            n = _trl.legacy_method_kind(trainer)
            how = f"TRL <= 1.14 {_trl.legacy_method_name(trainer)} ({n}-tuple) replaced"
        # >>> issue #28: name the no-grad dispatch to TRL's own head (fused path only: it compares with that head)
        heads = _targets(trainer) if path == "fused" else []
        nograd = _trl.nograd_detail(heads, getattr(trainer, "args", None))
        return f"{how} on {where}; kernel: {_kernel_name()}" + (f"; {nograd}" if nograd else "")
        # <<< issue #28


def _entropy_grad(trainer: Any) -> Callable[[], bool]:
    # TRL's entropy bonus needs the entropy's gradient; otherwise it is only logged/masked
    return lambda: bool(getattr(trainer, "_entropy_bonus_enabled", False))


def _make_forward(
    model: nn.Module, call: _trl.FusedCall, fallback: RuntimeFallback | None, original: Callable[..., Any]
):
    fast = functools.partial(_trl.fused_forward, model, call)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("fused_lm_head", False):
            return original(*args, **kwargs)
        # >>> issue #28: no-grad calls where TRL's own head measured faster go to it (_trl.nograd_uses_stock)
        if _trl.nograd_uses_stock(original, model, call.settings, kwargs):
            return original(*args, **kwargs)
        # <<< issue #28
        if fallback is None:
            return fast(*args, **kwargs)
        return fallback.call(fast, original, *args, **kwargs)

    return forward


def _guarded(fallback: RuntimeFallback, fast: Callable[..., Any], stock: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: fallback.call(fast, stock, *args, **kwargs)


def _run_op(
    guard: RuntimeFallback,
    tile_mib: int,
    keep_logits_mib: int,
    st: _trl.HeadSettings,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    need_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op on the best backend; a Triton failure falls back to the torch chunked path (warned once)."""

    def run(backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return ops.logp_entropy(
            hidden,
            weight,
            targets,
            temperature=st.temperature,
            logit_scale=st.logit_scale,
            softcap=st.softcap,
            need_entropy=need_entropy,
            entropy_grad=entropy_grad,
            tile_mib=tile_mib,
            backend=backend,
            keep_logits_mib=keep_logits_mib,
            weight_context=functools.partial(_trl.zero3_gather, weight) if hasattr(weight, "ds_id") else None,
        )

    if ops.default_backend(hidden.device) == "triton":
        # Triton launches on the current device: make it the tensors' one (models placed on cuda:1, device maps)
        with torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext():
            return guard.call(run, lambda _backend: run("torch"), "triton")
    return run("torch")
