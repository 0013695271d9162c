"""Grouped 4-bit MoE experts: one dequantize per projection stack and two grouped GEMMs instead of the
per-expert loop (a dequantize and two matmuls per expert), with the loop kept as the fallback.

Serves frozen bitsandbytes 4-bit experts in three layouts: per-expert ``Linear4bit`` lists (community pre-quantized
gpt-oss checkpoints), stock transformers 3-D experts quantized by :func:`quantize_experts_4bit`, and the
transformers 4.x sparse MoE blocks (ModuleLists of expert MLPs) loaded with ``BitsAndBytesConfig(load_in_4bit=True)``;
PEFT LoRA on the experts of each as split grouped GEMMs.

Files: one module per layout behind one interface (``layouts``: ``Found``, the ``Layout`` interface and the
structure layouts are recognized by; ``layout_expert_mlps``, ``layout_linear4bit``, ``layout_stacked``: each layout's
readiness, adapters and plan; ``registry``: the layouts by name, finding experts modules, the per-call plan),
``_checks`` the readiness checks they share, ``probe`` says whether each module can be served (and why not) and
returns the plan, ``plan`` the model plan's targets and what per-module plans are built with, ``patch`` installs them
(trainer glue), ``_adapters`` reads PEFT's expert adapters, ``recompute`` the measured recompute verdicts, ``saved``
what saving writes (and its state-dict hooks); the math: ``ops`` (grouped GEMMs and autograd), ``lora`` (split
LoRA), ``_custom_ops`` (the grouped kernels as ``torch.library`` ops, what ``torch.compile`` traces), ``_stacks`` /
``_qstate`` (packed 4-bit stacks and the stock names every layout reads), ``quantize``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ..optimization import Applied, Optimization, PatchContext, Readiness, install_command, register
from ._adapters import expert_lora_targets
from .probe import bnb_reason, readiness
from .quantize import QuantizeReport, quantize_experts_4bit
from .saved import DECLARATION


__all__ = ["Moe4bit", "expert_lora_targets", "QuantizeReport", "quantize_experts_4bit", "readiness"]


@register
class Moe4bit(Optimization):
    """Grouped 4-bit MoE experts (see the module docstring); ``moe_recompute`` re-dequantizes in backward."""

    name = "moe4bit"
    saved_weights = DECLARATION

    def check_environment(self) -> tuple[str, ...]:
        # Looked up, not imported: importing bitsandbytes logs backend notices, and only a model with MoE experts
        # needs it (the probe imports it then, and reports a broken install there).
        if importlib.util.find_spec("bitsandbytes") is None:
            return (bnb_reason() or f"bitsandbytes not installed: {install_command('bnb')}",)
        return ()

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        from .probe import probe

        return probe(trainer, ctx)

    def breaks_when_off(self, trainer: Any) -> str | None:
        from .probe import stock_lora_reason

        return stock_lora_reason(trainer)

    def apply(self, trainer: Any, plan: Any, ctx: PatchContext) -> Applied:
        from ._adapters import lora_detail
        from .patch import install, share

        lora = []
        for target in plan.targets:  # every change goes on ctx.undo as it is made (run if apply raises)
            adapters = install(target, plan.fsdp2, ctx.undo, ctx.fallback)
            lora += [adapters] if adapters is not None else []
        share(plan.targets, plan.fsdp2, ctx.undo)
        return Applied(tuple(t.name for t in plan.targets), plan.detail + lora_detail(lora))
