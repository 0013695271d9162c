"""Up-front input checks for the fused op, run before any kernel launch.

A bad pointer inside a Triton kernel is an illegal memory access that poisons the CUDA context (no fallback can
recover), so everything the kernels assume is checked on the host first, from shapes, dtypes and devices only (no
device sync). A failed check raises ``UnsupportedInput``; the trainer's run-time fallback turns that into the torch
backend (and, failing that, TRL's own head).
"""

from __future__ import annotations

import os

import torch


# Tile dtypes the Triton passes are written and tested for (they load the tile, fold in fp32 and store back).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT32_MAX = 2**31 - 1
# The fold's column blocks of one row: CUDA's grid y-dimension (65535), and the combine pass holds one partial per
# block of a row in registers (a full-vocabulary row chunk of the scalar loss has V / block of them)
MAX_FOLD_BLOCKS = 4096


class UnsupportedInput(ValueError):
    """The inputs are valid tensors but outside what the requested backend supports (or malformed)."""


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    backend: str,
    compute_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    fold_block: int = 4096,
) -> None:
    """Raise ``UnsupportedInput`` with the reason when the op cannot run these inputs on ``backend``."""
    for reason in input_reasons(hidden, weight, targets, backend, compute_dtype, bias, fold_block):
        raise UnsupportedInput(reason)


def input_reasons(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    backend: str,
    compute_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    fold_block: int = 4096,
) -> list[str]:
    reasons = _common_reasons(hidden, weight, targets) + _bias_reasons(weight, bias)
    if reasons or backend == "torch":
        return reasons
    if backend != "triton":
        return [f"unknown backend {backend!r}: expected 'torch' or 'triton'"]
    return _triton_reasons(hidden, compute_dtype) + _grid_reasons(weight.shape[0], fold_block)


def _common_reasons(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> list[str]:
    reasons = []
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        reasons.append(f"targets must be [N] with N = {hidden.shape[0]} rows of hidden, got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        reasons.append(f"targets must be an integer tensor, got {targets.dtype}")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not t.dtype.is_floating_point:
            reasons.append(f"{name} must be floating point, got {t.dtype} (a quantized LM head is not supported)")
    devices = {hidden.device, weight.device, targets.device}
    if len(devices) > 1:
        names = ", ".join(
            f"{n} on {t.device}" for n, t in (("hidden", hidden), ("weight", weight), ("targets", targets))
        )
        reasons.append(f"hidden, weight and targets must be on one device: {names}")
    if weight.shape[0] > _INT32_MAX:
        reasons.append(f"vocabulary of {weight.shape[0]} rows exceeds int32 column indexing")
    return reasons


def _bias_reasons(weight: torch.Tensor, bias: torch.Tensor | None) -> list[str]:
    """A head bias is read per vocab tile next to the weight: one value per vocabulary row, on its device."""
    if bias is None:
        return []
    reasons = []
    if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
        reasons.append(f"bias must be [V] with V = {weight.shape[0]} rows of weight, got {tuple(bias.shape)}")
    if not bias.dtype.is_floating_point:
        reasons.append(f"bias must be floating point, got {bias.dtype}")
    if bias.device != weight.device:
        reasons.append(f"bias on {bias.device} but weight on {weight.device}: they must be on one device")
    return reasons


def _triton_reasons(hidden: torch.Tensor, compute_dtype: torch.dtype) -> list[str]:
    reasons = []
    device = hidden.device
    if device.type != "cuda" and not (device.type == "cpu" and _interpreted()):
        reasons.append(f"the Triton backend runs on CUDA tensors, got {device}")
    elif device.index is not None and device.index != torch.cuda.current_device():
        # Triton launches on the current device; pointers of another GPU would be accessed from the wrong one
        reasons.append(
            f"tensors on {device} but the current CUDA device is cuda:{torch.cuda.current_device()}: "
            f"call under torch.cuda.device({device})"
        )
    if compute_dtype not in TRITON_DTYPES:
        reasons.append(f"the Triton backend computes in fp32/bf16/fp16, not {compute_dtype}")
    return reasons


def _grid_reasons(vocab: int, fold_block: int) -> list[str]:
    blocks = -(-vocab // fold_block)
    if blocks > MAX_FOLD_BLOCKS:
        return [
            f"vocabulary of {vocab} is {blocks} column blocks of {fold_block} for the Triton fold, more than its "
            f"{MAX_FOLD_BLOCKS}: use the torch backend"
        ]
    return []


def _interpreted() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, development and CI) runs the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
