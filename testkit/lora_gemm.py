"""The rounding bound of compile_layers' one-GEMM LoRA projection against PEFT's two GEMMs, and the runs both tests
(CPU and CUDA) compare.

PEFT's form rounds the base product ``a`` and the adapter product ``b`` to the 16-bit compute dtype, then their sum;
the one GEMM accumulates ``a + b`` in fp32 and rounds once. With ``u`` the dtype's unit roundoff, the two results
differ by at most ``u|a+b| + u|a| + u|b| + u|rnd(a)+rnd(b)|  <=  3u(|a| + |b|)`` (to first order), plus the fp32
accumulation of the GEMMs, at most ``inner · 2^-24`` of the absolute products' sum each. ``a`` and ``b`` are taken in
fp64 from the very 16-bit operands both forms multiply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32_ROUNDOFF = 2.0**-24


def sum_of_products_bound(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``pairs`` ``(left, right)`` of 16-bit operands whose products ``left @ right`` are summed: the elementwise
    bound on one rounding vs one per product and one for the sum, and the largest single product's magnitude
    (``|left @ right|``, to check the bound is small against what a missing term would change)."""
    exact = [left.double() @ right.double() for left, right in pairs]
    magnitude = [left.double().abs() @ right.double().abs() for left, right in pairs]
    inner = sum(left.shape[-1] for left, _ in pairs)
    bound = 3 * UNIT_ROUNDOFF[dtype] * sum(p.abs() for p in exact)
    bound = bound + 2 * inner * FP32_ROUNDOFF * sum(magnitude)
    return bound, torch.stack([p.abs() for p in exact]).amax(0)


def forward_and_grads(
    module: torch.nn.Module, forward: Callable[..., Any], x: torch.Tensor, grad: torch.Tensor, device: str
) -> list[torch.Tensor]:
    """Output, input grad, lora_A and lora_B grads of one call of ``forward(module, x)`` in bf16 autocast."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast(device, torch.bfloat16):
        out = forward(module, x)
    out.backward(grad.to(out.dtype))
    return [out, x.grad, module.lora_A["default"].weight.grad, module.lora_B["default"].weight.grad]


def operands(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The 16-bit operands both forms multiply (bf16 autocast): x, W (dequantized from 4 bits where the base is
    bitsandbytes'), A, B, the scaled rank-r activation and its gradient, flattened to rows."""
    bf16 = torch.bfloat16
    s = module.scaling["default"]
    x16 = x.to(bf16).reshape(-1, x.shape[-1])
    dy = grad.to(bf16).reshape(-1, grad.shape[-1])
    from leantrain.compile_layers.ops import dense_weight

    weight = module.base_layer.weight
    w = dense_weight(weight, getattr(weight, "quant_state", None), bf16)
    a, b = module.lora_A["default"].weight.to(bf16), module.lora_B["default"].weight.to(bf16)
    scaled = ((x16 @ a.t()) * s).to(bf16)
    grad_scaled = ((dy @ b) * s).to(bf16)
    return {"x": x16, "dy": dy, "w": w, "a": a, "b": b, "scaled": scaled, "grad_scaled": grad_scaled}
