"""Readiness checks the layouts share: PEFT wrapping a whole module, per-expert ``bnb.nn.Linear4bit`` projections
(plain, quantized, frozen, one format per stack, one device), the packed format the kernels read, and the per-layer
part of a readiness signature. Each layout module (``layout_*``) composes them into its own reason."""

from __future__ import annotations

import torch
from torch import nn

from . import _adapters
from ._stacks import MAX_ELEMENTS_PER_CALL, NESTED_BLOCKSIZE, state_tensors
from .plan import device_mix_reason, state_key, tensor_key


LORA_REASON = (
    "a PEFT tuner wraps an experts module or an expert MLP as a whole: the grouped 4-bit path serves LoRA on the "
    'expert projections (PEFT target_modules naming them, or "all-linear") and target_parameters LoRA on '
    "quantize_experts_4bit stacks"
)


def lora_reason(module: nn.Module, wrapped: dict[int, nn.Module]) -> str | None:
    """Why a PEFT tuner wrapping this whole module (an MoE block or an expert MLP) keeps it off the grouped path;
    None: not wrapped."""
    tuned = id(module) in wrapped or _adapters.is_tuned(module)
    return LORA_REASON if tuned else None


def linear4bit_tensors(name: str, layer: nn.Module) -> dict[str, torch.Tensor]:
    weight = layer.weight
    found = {f"{name} packed data": weight}
    found.update({f"{name} {k}": t for k, t in state_tensors(weight.quant_state).items()})
    if layer.bias is not None:
        found[f"{name} bias"] = layer.bias
    return found


def format_reason(qs_list: list, rows_cols: tuple[int, int]) -> str | None:
    """Checks shared by both layouts on the quant states of one projection stack."""
    first = qs_list[0]
    rows, cols = rows_cols
    if first.quant_type not in ("nf4", "fp4"):
        return f"unknown 4-bit quant_type {first.quant_type!r}"
    if (rows * cols) % first.blocksize or (rows * cols) % 2:
        return f"an expert's {rows}x{cols} elements are not a whole number of {first.blocksize}-element blocks"
    if rows * cols > MAX_ELEMENTS_PER_CALL:
        return f"an expert's {rows}x{cols} elements exceed bitsandbytes' 32-bit element count"
    if first.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"experts dequantize to {first.dtype}"
    if first.nested and first.state2.blocksize != NESTED_BLOCKSIZE:
        return f"double quantization with absmax blocksize {first.state2.blocksize} (bitsandbytes uses 256)"
    if rows % 8 or cols % 8:
        return f"expert dims {rows}x{cols} are not multiples of 8 (grouped_mm needs 16-byte aligned strides)"
    return None


def layer_reason(layer: nn.Module, wrapped: dict[int, nn.Module] | None) -> str | None:
    """One per-expert projection: a plain, quantized, frozen ``bnb.nn.Linear4bit`` in training layout (``wrapped``
    None: its adapters were checked already and ``layer`` is the Linear4bit under them)."""
    import bitsandbytes as bnb

    reason = lora_reason(layer, wrapped) if wrapped is not None else None
    if reason:
        return reason
    if type(layer) is not bnb.nn.Linear4bit:
        return f"an expert is a {type(layer).__name__}, not a plain bitsandbytes Linear4bit"
    weight = layer.weight
    if not isinstance(weight, bnb.nn.Params4bit) or getattr(weight, "quant_state", None) is None:
        return "an expert weight is not quantized yet (no quant_state): move the model to its device first"
    if weight.requires_grad or (layer.bias is not None and layer.bias.requires_grad):
        return "expert weights or biases require grad: the grouped path computes no expert gradients"
    if getattr(weight.quant_state, "packing_format_for_cpu", False):
        return (
            "an expert weight was repacked by bitsandbytes for its CPU inference kernel (an eval-mode forward without "
            "grad on CPU): patch the freshly loaded model, before evaluating it on CPU"
        )
    return None


def stack_reason(layers: list[nn.Module]) -> str | None:
    """Layers consolidated into one packed stack: one format, device, compute dtype and bias presence."""
    states = [layer.weight.quant_state for layer in layers]
    first = states[0]
    key = (first.quant_type, first.blocksize, first.dtype, tuple(first.shape), first.nested)
    bias_key = layers[0].bias is None
    if any((qs.quant_type, qs.blocksize, qs.dtype, tuple(qs.shape), qs.nested) != key for qs in states) or any(
        (layer.bias is None) != bias_key for layer in layers
    ):
        return "experts differ in quant_type, blocksize, dtype, shape, double quantization or bias"
    if len({layer.weight.device for layer in layers}) > 1 or len({layer.compute_dtype for layer in layers}) > 1:
        return "experts live on different devices or use different compute dtypes"
    if first.nested and any(not torch.equal(qs.state2.code, first.state2.code) for qs in states[1:]):
        return "experts use different double-quantization codes"
    return format_reason(states, tuple(int(s) for s in first.shape))


def layers_reason(named: dict[str, list[nn.Module]], wrapped: dict[int, nn.Module] | None) -> str | None:
    """Per-layer checks, then one device for every tensor the kernels read."""
    for layers in named.values():
        for layer in layers:
            reason = layer_reason(layer, wrapped)
            if reason:
                return reason
    tensors = {}
    for label, layers in named.items():
        for e, layer in enumerate(layers):
            tensors.update(linear4bit_tensors(f"{label}.{e}", layer))
    return device_mix_reason(tensors)


def layers_signature(layers: list[nn.Module], wrapped: dict[int, nn.Module]) -> list[tuple]:
    """Per-expert projections' part of a readiness signature: wrapper and layer objects, adapters, tensors with
    their devices, quantization state, compute dtype."""
    parts = []
    for layer in layers:
        inner = _adapters.base(layer)
        weight, bias = getattr(inner, "weight", None), getattr(inner, "bias", None)
        parts.append(
            (
                id(layer),
                id(inner),
                id(layer) in wrapped,
                _adapters.adapter_key(layer),
                tensor_key(weight) if isinstance(weight, torch.Tensor) else id(weight),
                state_key(getattr(weight, "quant_state", None)),
                tensor_key(bias) if isinstance(bias, torch.Tensor) else id(bias),
                getattr(inner, "compute_dtype", None),
            )
        )
    return parts


def layer_device_dtype(layer: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where a per-expert projection's kernels run and the dtype they compute in (under any LoRA)."""
    layer = _adapters.base(layer)
    return layer.weight.device, layer.compute_dtype or layer.weight.quant_state.dtype


def is_linear4bit(layers: list[nn.Module]) -> bool:
    """Every layer (under any LoRA) a ``bnb.nn.Linear4bit``, and at least one."""
    import bitsandbytes as bnb

    return bool(layers) and all(isinstance(getattr(m, "base_layer", m), bnb.nn.Linear4bit) for m in layers)
