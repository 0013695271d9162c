"""Fused GRPO/RLOO log-probs and entropies: no [B, T, V] logits, 2 GEMMs instead of 3 with a frozen LM head.

``probe.py`` finds the TRL path and the models (the plan), ``patch.py`` is the trainer glue (TRL's head settings,
the wrapped forwards, the no-grad dispatch to TRL's own head where it measured faster). The op is the shared LM-head
math in ``leantrain.lm_head``."""

from __future__ import annotations

import functools
from typing import Any

from ..fallback import RuntimeFallback
from ..lm_head.ops import logp_entropy
from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from . import patch as glue
from .probe import LogpsPlan, detail, probe


__all__ = ["GrpoLogps", "logp_entropy"]


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
        return probe(trainer, ctx)

    def apply(self, trainer: Any, plan: LogpsPlan, ctx: PatchContext) -> Applied:
        undo = ctx.undo
        kernel_guard = RuntimeFallback("grpo_logps triton kernel", ctx.fallback.strict)
        op = functools.partial(
            glue.run_op, kernel_guard, ctx.config.grpo_logps_tile_mib, ctx.config.grpo_logps_keep_logits_mib
        )
        names = []
        for label, model, settings in plan.targets:
            is_policy = label == "model"
            entropy_grad = glue.entropy_grad(trainer) if is_policy else (lambda: False)
            call = glue.FusedCall(settings, op, entropy_grad, trl_head=plan.path == "fused")
            # On the legacy path the model's own forward knows no `fused_lm_head`: the fallback sits one level up,
            # around the whole replaced method, whose stock version computes full logits.
            guard = ctx.fallback if plan.path == "fused" else None
            undo.wrap_method(model, "forward", functools.partial(glue.make_forward, model, call, guard))
            names.append(f"{label}.forward ({type(model).__name__})")
        if plan.path != "fused":
            n_values = glue.legacy_method_kind(trainer)
            method_name = glue.legacy_method_name(trainer)
            undo.wrap_method(
                trainer,
                method_name,
                lambda original: glue.guarded(ctx.fallback, glue.legacy_method(trainer, original, n_values), original),
            )
            names.append(f"{type(trainer).__name__}.{method_name}")
        return Applied(tuple(names), detail(trainer, plan.path))
