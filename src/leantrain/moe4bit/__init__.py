"""Grouped 4-bit MoE experts: one dequantize per projection stack and two grouped GEMMs instead of the
per-expert loop (a dequantize and two matmuls per expert), with the loop kept as the fallback.

Serves frozen bitsandbytes 4-bit experts in three layouts: per-expert ``Linear4bit`` lists (community pre-quantized
gpt-oss checkpoints), stock transformers 3-D experts quantized by :func:`quantize_experts_4bit`, and the
transformers 4.x sparse MoE blocks (ModuleLists of expert MLPs) loaded with ``BitsAndBytesConfig(load_in_4bit=True)``.

Files: ``layouts`` finds experts modules, ``probe`` says whether each can be served (and why not), ``plan`` builds
what the grouped path serves, ``patch`` the installed forwards (trainer glue), ``_adapters`` reads PEFT's expert
adapters; the math: ``_grouped`` (grouped GEMMs and autograd), ``lora`` (split LoRA), ``_stacks`` / ``_qstate``
(packed 4-bit stacks), ``_triton`` (fused kernel), ``quantize``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..models import data_parallel_reason, unwrap_model
from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from ._adapters import expert_lora_targets
from .probe import bnb_reason, fsdp_reason, readiness
from .quantize import QuantizeReport, quantize_experts_4bit
from .saved import DECLARATION


__all__ = ["Moe4bit", "expert_lora_targets", "QuantizeReport", "quantize_experts_4bit", "readiness"]


@register
class Moe4bit(Optimization):
    """Grouped 4-bit MoE experts (see the module docstring); ``moe_recompute`` re-dequantizes in backward."""

    name = "moe4bit"
    saved_weights = DECLARATION

    def check_environment(self) -> tuple[str, ...]:
        reason = bnb_reason()
        return (reason,) if reason else ()

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        from .layouts import find_experts
        from .plan import ModelPlan
        from .probe import ZERO3_REASON, zero3

        ready = readiness(trainer.model)
        if not ready.ready:
            return ready
        if zero3(trainer):
            return Readiness.no(ZERO3_REASON)
        reason = fsdp_reason(trainer, trainer.model) or data_parallel_reason(
            trainer,
            "the grouped experts forward is patched on the module instance and its plan holds the packed "
            "stacks of the first GPU, so every replica would compute there",
        )
        if reason:
            return Readiness.no(reason)
        return dataclasses.replace(ready, plan=ModelPlan(find_experts(unwrap_model(trainer.model)), ready.detail))

    def apply(self, trainer: Any, plan: Any, ctx: PatchContext) -> Applied:
        from . import _adapters
        from .layouts import block_recipe
        from .patch import block_forward, experts_forward, fixed
        from .plan import build_plan, live_stacked_plan
        from .probe import fsdp2

        model = unwrap_model(trainer.model)
        recompute = bool(ctx.config.moe_recompute)
        live = fsdp2(trainer)  # FSDP2 swaps whole stacks in per call: the plan is rebuilt around them per call
        targets = []
        wrapped = _adapters.wrapped_map(model)
        lora = []
        for found in plan.experts:  # every change goes on ctx.undo as it is made (run if apply raises)
            if live:
                plan_for = live_stacked_plan(found.module, recompute)
            else:
                plan_for = fixed(*build_plan(found, ctx.undo.push, recompute))
            # PEFT LoRA on the experts: the plan carries the adapters
            adapters = _adapters.adapters_for(found.layout, found.module, wrapped, ctx.undo.push)
            lora += [adapters] if adapters is not None else []
            plan_for = _adapters.with_adapters(plan_for, adapters)
            recipe = block_recipe(found.module) if found.layout == "expert_mlps" else None
            if recipe is not None and recipe.hook == "forward":  # 4.x block: router, routing, experts, shared expert
                make = block_forward(found.module, plan_for, recipe.normalize, recipe.shared, ctx.fallback)
                ctx.undo.wrap_method(found.module, "forward", make)
            elif recipe is not None:  # DeepSeek-V2's experts step moe(hidden, topk_ids, topk_weight)
                ctx.undo.wrap_method(found.module, recipe.hook, experts_forward(plan_for, ctx.fallback))
            else:
                # target_parameters LoRA is called through its outermost ParamWrapper, whose forward is replaced
                owner = _adapters.forward_owner(wrapped, found.module)
                make = _adapters.owner_forward(experts_forward(plan_for, ctx.fallback), owner, found.module, wrapped)
                ctx.undo.wrap_method(owner, "forward", make)
            targets.append(found.name)
        detail = plan.detail + f"; recompute {'on' if recompute else 'off'}"
        detail += "; FSDP2: plan rebuilt per call around the unsharded stacks" if live else ""
        detail += _adapters.lora_detail(lora)
        return Applied(tuple(targets), detail)
