"""Fused causal-LM loss: the training loss of SFTTrainer and a plain Trainer from the last hidden states and the LM
head weight, never the ``[B, T, V]`` logits; TRL's ``entropy`` and ``mean_token_accuracy`` from the same pass.

``probe.py`` finds the loss path (TRL's fused head, its chunked cross-entropy, the full-logits loss of TRL <= 1.14
or of a plain Trainer) and the measured dispatch (``dispatch.py``), ``patch.py`` and ``legacy.py`` are the trainer
glue. The op is the shared LM-head math in ``leantrain.lm_head``."""

from __future__ import annotations

import functools
from typing import Any

from .. import trl_head
from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from . import legacy
from . import patch as glue
from . import probe as planner
from .probe import CePlan, detail


@register
class FusedCE(Optimization):
    name = "fused_ce"
    trainer_kinds = ("sft", "trainer")

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        return planner.probe(trainer, ctx)

    def apply(self, trainer: Any, plan: CePlan, ctx: PatchContext) -> Applied:
        kernel_guard = trl_head.kernel_guard(self.name, ctx.fallback)
        op = functools.partial(glue.run_op, kernel_guard, ctx.config.fused_ce_tile_mib)
        model, st, undo = plan.model, plan.settings, ctx.undo
        model_name = f"{type(model).__name__}.forward"
        if plan.path == "trl_fused":
            fast = functools.partial(glue.trl_fused_forward, model, st, op, plan.output_class)
            undo.wrap_method(model, "forward", functools.partial(glue.make_trl_fused_forward, fast, ctx.fallback))
            return Applied((model_name,), detail(plan))
        if plan.path == "chunked_nll":
            fast = functools.partial(glue.chunked_forward, model, st, op, plan.output_class)
            undo.wrap_method(model, "forward", functools.partial(glue.make_chunked_forward, fast, ctx.fallback))
            return Applied((model_name,), detail(plan))
        parts = glue.ModelParts(st, plan.moe, plan.aux_loss)
        fast = functools.partial(glue.request_forward, model, parts, op)
        undo.wrap_method(model, "forward", functools.partial(glue.make_request_forward, fast))
        names = [model_name, f"{type(trainer).__name__}.compute_loss"]
        if plan.path == "trainer":
            runtime = glue.TrainerLoss(ctx.fallback)
            undo.wrap_method(trainer, "compute_loss", runtime.wrap_compute_loss)
            undo.wrap_method(trainer, "prediction_step", runtime.wrap_prediction_step)
            names.append(f"{type(trainer).__name__}.prediction_step")
        else:
            make = functools.partial(legacy.make_compute_loss, trainer, plan.variant, ctx.fallback)
            undo.wrap_method(trainer, "compute_loss", make)
        return Applied(tuple(names), detail(plan))


__all__ = ["FusedCE"]
