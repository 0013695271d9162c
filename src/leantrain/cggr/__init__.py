"""CGGR: keep labels only on the hardest tokens of each sequence, scored by the model's own decoder layers (up to
``cggr_router_layers``) inside the training forward (no second pass). ``probe.py`` decides and plans, ``patch.py``
is the run-time flow on the trainer, ``ops.py`` the selection and scoring math.

Opt-in: it changes which tokens train, so ``patch_trainer(trainer)`` leaves it off (``cggr=True`` or
``LEANTRAIN_CGGR=1``; ``LEANTRAIN_CGGR=auto`` applies it only where the probe expects a speed-up)."""

from __future__ import annotations

from typing import Any

from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from .ops import head_share, schedule_ratio, score_tokens, select_topk
from .patch import Runtime, Settings
from .probe import AUTO_MIN_HEAD_SHARE, CggrPlan, describe_router, loss_path, probe, resolve_router_layer


@register
class CGGR(Optimization):
    name = "cggr"
    trainer_kinds = ("sft", "trainer")
    removes_metrics = ("TRL's entropy and mean_token_accuracy cover the kept tokens only",)
    off_by_default_why = "changes which tokens train"

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        return probe(trainer, ctx)

    def apply(self, trainer: Any, plan: CggrPlan, ctx: PatchContext) -> Applied:
        config = ctx.config
        settings = Settings(
            ratio=config.cggr_min_tokens_ratio,
            router_layers=plan.router_layer,
            scoring=config.cggr_scoring,
            warmup=config.cggr_warmup_steps,
            schedule=config.cggr_ratio_schedule,
            kept_only=plan.kept_only,
        )
        if trainer.args.world_size > 1:
            # A fallback on one rank alone would skip the kept-count gather the other ranks still make (a hang):
            # under several processes a run-time error raises instead.
            ctx.fallback.strict = True
        runtime = Runtime(trainer, plan.parts, settings, ctx.fallback)
        undo = ctx.undo
        layer = plan.parts.layers[plan.router_layer - 1]
        if settings.scoring != "random":  # the random control needs no hidden state
            undo.push(layer.register_forward_hook(runtime.hook).remove)
        undo.wrap_method(trainer, "compute_loss", runtime.wrap_compute_loss)
        undo.wrap_method(trainer, "get_batch_samples", runtime.wrap_get_batch_samples)
        undo.wrap_method(trainer, "log", runtime.wrap_log)
        undo.set_attr(trainer, "_leantrain_cggr", runtime)
        layer_name = f"{type(plan.parts.trunk).__name__}.layers[{plan.router_layer - 1}]"
        targets = ("trainer.compute_loss", "trainer.get_batch_samples", "trainer.log", f"{layer_name} forward hook")
        detail = (
            f"{describe_router(plan.router_layer, plan.parts.num_layers)} "
            f"(in-forward hook, scoring={settings.scoring}, ratio={settings.ratio}, warmup={settings.warmup} "
            f"optimizer steps, {settings.schedule}); loss path: {plan.path}"
        )
        return Applied(targets if settings.scoring != "random" else targets[:3], detail)


__all__ = [
    "AUTO_MIN_HEAD_SHARE",
    "CGGR",
    "Runtime",
    "Settings",
    "describe_router",
    "head_share",
    "loss_path",
    "resolve_router_layer",
    "schedule_ratio",
    "score_tokens",
    "select_topk",
]
