"""Layer kernels: Liger-Kernel's RMSNorm, SwiGLU / GeGLU and RoPE Triton kernels on one model's module instances.

Liger's own ``apply_liger_kernel_to_<family>`` also rebinds classes and functions of transformers' modeling module for
the whole process; here each norm, MLP and attention instance of the trained model gets a forward that calls Liger's
autograd functions with the family's own rounding (Gemma's ``(1 + w)`` in fp32, Llama's cast before the weight), and
``unpatch_trainer`` puts the class forwards back. ``families.py`` holds what each family needs and where the kernels
measured faster: auto mode applies them only there. ``probe.py`` decides and plans, ``patch.py`` binds the forwards,
``ops.py`` calls the kernels (plain values)."""

from __future__ import annotations

from typing import Any

from ..optimization import Applied, Optimization, PatchContext, Readiness, install_command, register
from .families import FAMILIES, MEASURED, Family
from .probe import LayerKernelsPlan, describe, liger_reason
from .probe import probe as probe_trainer  # the submodule keeps its name


@register
class LayerKernels(Optimization):
    name = "layer_kernels"
    trainer_kinds = ("sft", "trainer", "grpo")

    def check_environment(self) -> tuple[str, ...]:
        import importlib.util

        import torch

        reasons = []
        if importlib.util.find_spec("liger_kernel") is None:
            reasons.append(f"liger_kernel is not installed: {install_command('kernels')}")
        if not torch.cuda.is_available():
            reasons.append("needs CUDA (Liger-Kernel's kernels are Triton kernels for CUDA)")
        return tuple(reasons)

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        return probe_trainer(trainer, ctx)

    def apply(self, trainer: Any, plan: LayerKernelsPlan, ctx: PatchContext) -> Applied:
        from .patch import install

        targets = install(plan, ctx.undo, ctx.fallback)
        return Applied(targets, describe(plan))


__all__ = ["FAMILIES", "MEASURED", "Family", "LayerKernels", "LayerKernelsPlan", "liger_reason"]
