"""The layer kernels' math, in plain values: Liger-Kernel's Triton ops (CUDA), loaded on first use so that importing
leantrain never imports liger_kernel.

Each function computes what the family's stock module computes, with the family's own rounding points (the
``casting`` mode and ``offset`` of its RMSNorm); the stock forwards stay the reference (tests/gpu)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


_KERNELS: SimpleNamespace | None = None
# Liger's fused row kernels hold one row in a block of the next power of two, up to this many columns
# (liger_kernel.ops.utils.calculate_settings raises beyond it); the SwiGLU kernel tiles wider rows.
MAX_FUSED_COLUMNS = 65536


def kernels() -> SimpleNamespace:
    """Liger's autograd functions, imported once (liger_kernel.ops takes seconds to import)."""
    global _KERNELS
    if _KERNELS is None:
        from liger_kernel.ops import LigerGELUMulFunction, LigerRMSNormFunction, LigerSiLUMulFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        _KERNELS = SimpleNamespace(
            rms_norm=LigerRMSNormFunction, silu_mul=LigerSiLUMulFunction, gelu_mul=LigerGELUMulFunction,
            rope=liger_rotary_pos_emb,
        )  # fmt: skip
    return _KERNELS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    """``x / rms(x) * (offset + weight)`` over the last dimension, rounded where the family rounds (``casting``).

    Never in place: Liger's in-place backward writes the input gradient over the output gradient, which another
    consumer may share (Gemma 2's post-norms feed a residual add, whose backward hands both inputs one tensor)."""
    return kernels().rms_norm.apply(x, weight, eps, offset, casting, False, None)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: silu in fp32 rounded to the input dtype, then the product, as ``act_fn(gate) * up``."""
    return kernels().silu_mul.apply(gate, up, 1.0, 1.0)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (the tanh approximation: transformers' ``gelu_pytorch_tanh``)."""
    return kernels().gelu_mul.apply(gate, up)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[Any, Any]:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` (rotate-half form) with Liger's kernel,
    which rotates q and k in their own storage (the projections' outputs, which no backward keeps)."""
    return kernels().rope(q, k, cos, sin, None, unsqueeze_dim)
