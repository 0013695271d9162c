"""Torch stand-ins for leantrain.layer_kernels.ops (Liger-Kernel's Triton ops run on CUDA only): the same plain
arguments, the rounding points Liger documents for each casting mode, and a call count per op. CPU tests, the
benchmarks' ``--smoke`` runs and the CUDA tests' CPU dry run (GPU_TEST_DEVICE=cpu) use them to drive the probe,
the plan, the bound forwards, the fallback and the undo; the CUDA tests hold the real kernels to the stock path.

In fp32 each stand-in is the stock module's own arithmetic, op for op, so a patched model that routes every call
correctly (right epsilon, offset, casting, activation) reproduces the stock model bitwise."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.nn.functional as F


CALLS: Counter[str] = Counter()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    CALLS["rms_norm"] += 1
    xf = x.float()
    if casting == "gemma":  # all in fp32, one cast at the end (Gemma2RMSNorm)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (offset + weight.float())).type_as(x)
    assert casting == "llama", casting  # rstd in fp32, cast back, weight in the input dtype (LlamaRMSNorm)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight if offset == 0 else offset + weight
    return scale * normed.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    CALLS["swiglu"] += 1
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    CALLS["geglu"] += 1
    return F.gelu(gate, approximate="tanh") * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
    CALLS["rope"] += 1
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@contextlib.contextmanager
def emulated(devices: tuple[str, ...] = ("cuda", "cpu")) -> Iterator[Counter[str]]:
    """The stand-ins in place of Liger's ops and ``devices`` accepted by the probe, restored on exit; yields the
    call counts (reset on entry)."""
    from leantrain.layer_kernels import ops, probe

    saved = {name: getattr(ops, name) for name in ("rms_norm", "swiglu", "geglu", "rope")}
    saved_devices, saved_reason = probe.KERNEL_DEVICES, probe.liger_reason
    CALLS.clear()
    for name in saved:
        setattr(ops, name, globals()[name])
    probe.KERNEL_DEVICES, probe.liger_reason = devices, lambda: None
    try:
        yield CALLS
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)
        probe.KERNEL_DEVICES, probe.liger_reason = saved_devices, saved_reason
