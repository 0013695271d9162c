"""Fused GRPO/RLOO log-probs and entropies: no [B, T, V] logits, 2 GEMMs instead of 3 with a frozen LM head.

``probe.py`` reads TRL (its fused head's settings, or the older method) and makes the plan, ``patch.py`` holds the
wrappers ``apply`` installs, ``nograd.py`` the rule that sends no-grad calls to TRL's own head (it measured faster).
The op is the shared LM-head math in ``leantrain.lm_head``."""

from __future__ import annotations

import functools
from typing import Any

from .. import trl_head
from ..lm_head.ops import logp_entropy
from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from . import patch as glue
from .probe import LogpsPlan
from .probe import probe as probe_trainer  # the package's `probe` stays the module


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
        return probe_trainer(trainer, ctx)

    def apply(self, trainer: Any, plan: LogpsPlan, ctx: PatchContext) -> Applied:
        kernel_guard = trl_head.kernel_guard(self.name, ctx.fallback)
        op = functools.partial(
            glue.run_op, kernel_guard, ctx.config.grpo_logps_tile_mib, ctx.config.grpo_logps_keep_logits_mib
        )
        guard = ctx.fallback if plan.guards_forwards else None
        names = []
        for label, model, settings in plan.targets:
            entropy_grad = glue.entropy_grad(trainer) if label == "model" else (lambda: False)
            call = glue.FusedCall(settings, op, entropy_grad, trl_head=plan.path == "fused")
            ctx.undo.wrap_method(model, "forward", functools.partial(glue.make_forward, model, call, guard))
            names.append(f"{label}.forward ({type(model).__name__})")
        if plan.legacy is not None:
            name, n_values = plan.legacy.name, plan.legacy.n_values
            ctx.undo.wrap_method(
                trainer,
                name,
                lambda original: glue.guarded(ctx.fallback, glue.legacy_method(trainer, original, n_values), original),
            )
            names.append(f"{type(trainer).__name__}.{name}")
        return Applied(tuple(names), plan.detail)
