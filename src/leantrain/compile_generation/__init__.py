"""Compiled decoding for GRPO / RLOO: transformers' ``generate`` with its decode step compiled over a static KV cache.

A GRPO step without vLLM is mostly generation, and generation is launch-bound: one small forward per new token.
Compiling the decode step (CUDA graphs on CUDA) removes most of that overhead. ``probe.py`` decides (does TRL
generate with transformers here, can this model decode from a static cache under ``torch.compile``, does the
measured saving pay the compile back within the run's generation calls: ``measured.py``), ``patch.py`` wraps the
model's ``generate`` for TRL's calls, ``ops.py`` holds the cache sizing and the pay-back arithmetic (plain values)."""

from __future__ import annotations

from typing import Any

from ..compiling import unsupported_reason
from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from .measured import MEASURED, Measured
from .probe import GenerationPlan, describe
from .probe import probe as probe_trainer  # the submodule keeps its name


@register
class CompileGeneration(Optimization):
    name = "compile_generation"
    trainer_kinds = ("grpo",)

    def check_environment(self) -> tuple[str, ...]:
        reason = unsupported_reason()
        return (reason,) if reason else ()

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        return probe_trainer(trainer, ctx)

    def apply(self, trainer: Any, plan: GenerationPlan, ctx: PatchContext) -> Applied:
        from .patch import install

        return Applied(install(plan, ctx.undo, ctx.fallback, trainer), describe(plan))


def stats(trainer: Any) -> Any:
    """The live counts of a patched trainer (``.compiles``, ``.recompiles``, ``.calls``, ``.lengths``), or None."""
    from .patch import STATS_ATTR

    return getattr(trainer, STATS_ATTR, None)


__all__ = ["MEASURED", "CompileGeneration", "GenerationPlan", "Measured", "stats"]
