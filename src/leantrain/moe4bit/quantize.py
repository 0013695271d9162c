"""``leantrain.quantize_experts_4bit``: store stock transformers 3-D MoE expert stacks as packed 4-bit stacks.

``BitsAndBytesConfig`` quantizes only ``nn.Linear`` layers, so the 3-D expert parameters of transformers 5.x MoE
models (gpt-oss, Qwen3-MoE, Mixtral, OLMoE, ...) stay in bf16 and dominate the memory of a 4-bit fine-tune. This
quantizes each stack with bitsandbytes' own parametrization (``bitsandbytes.nn.parametrize``): the stock experts
forward keeps working (the stack is dequantized on access), and leantrain's grouped 4-bit path uses the packed
bytes directly. The quantization state follows the module through ``.to()`` / ``.cuda()`` / dtype changes and
``state_dict`` -> ``load_state_dict`` (see ``_qstate``), which bitsandbytes' own parametrization does not do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ._stacks import BIAS_NAMES, MAX_ELEMENTS_PER_CALL, STACK_NAMES


logger = logging.getLogger("leantrain")


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_experts_4bit` did: the experts modules and the bytes of their stacks before/after."""

    modules: tuple[str, ...]
    bytes_before: int
    bytes_after: int
    quant_type: str
    blocksize: int
    notes: tuple[str, ...] = field(default=())

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    def __str__(self) -> str:
        gib = 2**30
        return (
            f"quantize_experts_4bit: {len(self.modules)} experts modules to {self.quant_type} (blocksize "
            f"{self.blocksize}): expert stacks {self.bytes_before / gib:.3f} GiB -> {self.bytes_after / gib:.3f} GiB "
            f"(saved {self.saved_bytes / gib:.3f} GiB)"
        )


def stock_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Experts modules with plain 3-D ``gate_up_proj`` / ``down_proj`` parameters (not yet quantized)."""
    found = []
    for name, module in model.named_modules():
        params = module._parameters
        if all(isinstance(params.get(n), nn.Parameter) and params[n].dim() == 3 for n in STACK_NAMES):
            found.append((name, module))
    return found


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _stack_bytes(module: nn.Module) -> int:
    from torch.nn.utils import parametrize

    total = 0
    for name in STACK_NAMES:
        if parametrize.is_parametrized(module, name):
            plist = module.parametrizations[name]
            state = plist[0].quant_state
            total += _bytes(plist.original) + _bytes(state.absmax)
            if state.nested:
                total += _bytes(state.state2.absmax)
        else:
            total += _bytes(module._parameters[name])
    return total


def quantize_experts_4bit(
    model: nn.Module, quant_type: str = "nf4", blocksize: int = 64, compress_statistics: bool = False
) -> QuantizeReport:
    """Quantize every stock 3-D experts stack of ``model`` in place to one packed 4-bit stack (frozen, with its
    ``QuantState``) and freeze the expert biases. Returns (and logs) the memory of the stacks before and after.

    Quantizing before or after moving the model to its device gives the same model: the quantization state moves
    with ``.to(device)`` / ``.cuda()``, and ``.to(dtype)`` changes the dtype the stacks dequantize to (never the
    packed bytes or the fp32 absmax). ``model.state_dict()`` holds bitsandbytes' serialized form, which
    ``load_state_dict`` reads back into a model quantized with the same settings.

    Raises ValueError for a bad ``quant_type`` / ``blocksize``, a model without stock 3-D experts, or a stack whose
    element count is not a multiple of ``blocksize`` or exceeds bitsandbytes' 32-bit element count.
    """
    import bitsandbytes as bnb  # noqa: F401  (a clear ImportError before touching the model)
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    from . import _qstate
    from .saved import load_pre_hook

    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"blocksize must be a power of two in [32, 4096], got {blocksize!r}")
    targets = stock_experts(model)
    if not targets:
        from .._compat import TRANSFORMERS_3D_EXPERTS, needs

        older = needs("transformers", TRANSFORMERS_3D_EXPERTS, "3-D MoE experts")
        raise ValueError(
            f"{type(model).__name__} has no MoE experts with 3-D gate_up_proj/down_proj parameters to quantize"
            + (f" ({older})" if older else "")
        )
    for name, module in targets:  # validate everything before changing anything
        for stack in STACK_NAMES:
            n = module._parameters[stack].numel()
            per_expert = n // module._parameters[stack].shape[0]
            if per_expert % blocksize:
                raise ValueError(f"{name}.{stack}: {per_expert} elements per expert is not a multiple of {blocksize}")
            if n > MAX_ELEMENTS_PER_CALL:
                raise ValueError(f"{name}.{stack}: {n} elements exceed bitsandbytes' 32-bit element count (2**31 - 1)")
    before = sum(_stack_bytes(m) for _, m in targets)
    for _, module in targets:
        for stack in STACK_NAMES:
            replace_parameter_4bit(
                module, stack, compress_statistics=compress_statistics, quant_type=quant_type, blocksize=blocksize
            )
            _qstate.install(module, stack)
        module.register_load_state_dict_pre_hook(load_pre_hook)
        for bias in BIAS_NAMES:
            param = module._parameters.get(bias)
            if param is not None:
                param.requires_grad_(False)
    report = QuantizeReport(
        tuple(name for name, _ in targets), before, sum(_stack_bytes(m) for _, m in targets), quant_type, blocksize
    )
    logger.info(str(report))
    return report
