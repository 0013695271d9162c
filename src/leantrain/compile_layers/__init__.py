"""Compiled decoder layers: one regional ``torch.compile`` of the decoder layer's forward, shared by every layer.

Compiling layer by layer (not the whole model) keeps the compile short, leaves the head, the loss and the trainer
eager, and lets transformers' gradient checkpointing wrap each compiled layer. ``probe.py`` decides (what stops
Dynamo here, and in auto mode whether the measured saving pays the compile back within the run: ``measured.py``),
``patch.py`` binds the compiled forward and counts recompiles, ``ops.py`` holds the private code copy and the
pay-back arithmetic (plain values)."""

from __future__ import annotations

from typing import Any

from ..compiling import unsupported_reason
from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from .measured import MEASURED, Measured
from .probe import CompilePlan, describe
from .probe import probe as probe_trainer  # the submodule keeps its name


@register
class CompileLayers(Optimization):
    name = "compile_layers"
    trainer_kinds = ("sft", "trainer", "grpo")

    def check_environment(self) -> tuple[str, ...]:
        reason = unsupported_reason()
        return (reason,) if reason else ()

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        return probe_trainer(trainer, ctx)

    def apply(self, trainer: Any, plan: CompilePlan, ctx: PatchContext) -> Applied:
        from .patch import install

        targets, taken, folded, mlps = install(plan, ctx.undo, ctx.fallback, trainer)
        detail = describe(plan)
        if folded:
            detail += (
                f"; LoRA scaling applied to the rank-r activations in {folded} linears (a power of two: the same "
                "bits, without the backward's scaled full-width gradient copies)"
            )
        if mlps:
            detail += (
                f"; {mlps} gated LoRA MLPs run their backward in {plan.mlp_chunks} row chunks (a lower layer peak for "
                "more host work; the same forward bits)"
            )
            if plan.mlp_min_rows:
                detail += (
                    f" on micro-batches of at least {plan.mlp_min_rows} tokens (half of batch x max_length: the "
                    "largest set the step's peak; smaller ones keep autograd's backward)"
                )
        if taken:
            detail += (
                f"; compiles instead of layer_kernels inside the layers ({taken} Liger forwards set back to stock: "
                "inductor fuses the norms and activations; Liger's autograd functions failed Dynamo's trace on "
                "torch 2.11)"
            )
        return Applied(targets, detail)


def stats(trainer: Any) -> Any:
    """The live compile counts of a patched trainer (``.compiles``, ``.recompiles``), or None."""
    from .patch import STATS_ATTR

    return getattr(trainer, STATS_ATTR, None)


__all__ = ["MEASURED", "CompileLayers", "CompilePlan", "Measured", "stats"]
