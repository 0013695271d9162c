"""The fused 4-bit grouped GEMM (``leantrain.moe4bit._triton``) on CUDA: bitwise dequantize against bitsandbytes at
gpt-oss sizes, the GEMM against grouped_mm on the dequantized stack, whole gpt-oss layers (fwd + bwd) against the
default ``kernel="dequant"`` path, no host syncs, and peak memory.

Run: ``python3 -m pytest -q -m gpu tests/gpu/test_moe4bit_triton_cuda.py``. Import-safe without CUDA / triton (skips).

Tolerances (``tests/parity/test_moe4bit_triton.py`` derives the same bounds; TF32 is off, see ``conftest.cuda``):
- GEMM, per element: the fused tile is bitwise the dequantized stack (first test), so the two GEMMs differ only in
  summation order: two fp32 dot products of length K are each within ``K * u * (|a| @ |B|)`` of the exact value
  (u = eps32 / 2), hence ``K * eps32 * (|a| @ |B|)`` apart; bf16/fp16 outputs add one rounding each (monotone: at
  most one ulp apart, one ulp <= ``eps * max(|ours|, |ref|)``).
- Whole layer (relative Frobenius error): every bf16 GEMM output, gate and combine may round to a different
  neighbour: ``4 * eps_bf16`` (3.1e-2) for outputs, twice that for gradients (twice as many roundings); the
  existing CUDA suite's bound, which any wrong expert / bias / orientation (O(1) errors) exceeds by far.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")
bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbf  # noqa: E402

import leantrain  # noqa: E402
from leantrain.moe4bit import _grouped, _triton  # noqa: E402
from leantrain.moe4bit._stacks import stack_from_quant_state  # noqa: E402
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.moe4bit.plan import build_plan  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from tests._moe4bit_models import linear4bit_experts_from  # noqa: E402


H = INTER = 2880  # gpt-oss-20b / 120b hidden and expert sizes
EPS32 = torch.finfo(torch.float32).eps
EPS = {torch.bfloat16: torch.finfo(torch.bfloat16).eps, torch.float16: torch.finfo(torch.float16).eps}
LAYER_REL = 4 * torch.finfo(torch.bfloat16).eps


@pytest.fixture(autouse=True)
def _fp32_reductions():
    """cuBLAS may reduce fp16/bf16 split-K partial sums in half precision by default, which the fp32-accumulation
    bounds do not cover: off for these tests (restored afterwards)."""
    m = torch.backends.cuda.matmul
    old = m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction
    m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = False
    yield
    m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = old


def packed_stack(shape: tuple[int, int, int], quant_type: str, nested: bool, device: torch.device):
    """A 3-D stack quantized by bitsandbytes on the device, plus its (packed, quant_state) for direct calls."""
    w = torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02
    packed, qs = bnbf.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=nested)
    return stack_from_quant_state(packed, qs), packed, qs


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_dequantize_kernel_bitwise_equals_bitsandbytes(cuda, quant_type, nested):
    """A gpt-oss gate_up slice (4 experts of 2880 x 5760): the GEMM's dequantize helper writes exactly the values of
    bitsandbytes' CUDA ``dequantize_4bit`` (code table * fp32 absmax, rounded to nearest even) in every dtype."""
    stack, packed, qs = packed_stack((4, H, 2 * INTER), quant_type, nested, cuda)
    direct = bnbf.dequantize_4bit(packed.view(-1, 1), qs)  # bitsandbytes' own call, in the stack's bf16
    assert torch.equal(_triton.dequantize_4bit(stack, torch.bfloat16), direct)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # other dtypes: bitsandbytes via PackedStack
        ours, ref = _triton.dequantize_4bit(stack, dtype), stack.dequantize(dtype)
        assert torch.equal(ours, ref), f"{dtype}: max abs diff {(ours.float() - ref.float()).abs().max().item():.3g}"


def _groups(rows: int, experts: int, device: torch.device) -> torch.Tensor:
    """int32 group ends: uneven sizes, an empty first, middle and last group, one group far above BLOCK_M."""
    weights = torch.rand(experts, generator=torch.Generator().manual_seed(0)) + 0.1
    weights[[0, experts // 2, experts - 1]] = 0
    weights[1] *= 8
    sizes = (weights / weights.sum() * rows).floor().long()
    sizes[1] += rows - sizes.sum()
    return sizes.cumsum(0).to(device=device, dtype=torch.int32)


def _bound(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``K * eps32 * (|a| @ |B_g|)`` per output element (fp32 products of exact bf16/fp16/fp32 inputs)."""
    return a.shape[1] * EPS32 * _grouped.grouped_mm(a.abs().float(), b.abs().float(), offs).double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("transpose", [False, True], ids=["W", "W^T"])
def test_fused_gemm_matches_grouped_mm_on_the_dequantized_stack(cuda, transpose, dtype):
    """Forward orientation (``W[g]``, stored [E, K, N]) and the dX one (``W[g]^T``) at gpt-oss sizes, 8 experts,
    1500 rows in uneven groups (empty ones included), per-element bound from the module docstring."""
    stack, _, _ = packed_stack((8, H, 2 * INTER), "nf4", True, cuda)
    offs = _groups(1500, 8, cuda)
    w = stack.dequantize(dtype)
    b = w.transpose(1, 2) if transpose else w
    a = torch.randn(1500, b.shape[1], device=cuda).to(dtype)
    ours = _triton.grouped_mm_4bit(a, stack, offs, transpose)
    ref = _grouped.grouped_mm(a, b, offs)
    bound = _bound(a, b, offs)
    if dtype != torch.float32:
        bound = bound + EPS[dtype] * torch.maximum(ours.double().abs(), ref.double().abs())
    err = (ours.double() - ref.double()).abs()
    assert torch.isfinite(ours).all()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


def _gpt_oss_layer(device: torch.device, experts: int, layout: str) -> torch.nn.Module:
    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=experts)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    stock = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    with torch.no_grad():
        for p in stock.parameters():
            p.normal_(0, 0.02)
    stock = stock.to(device=device, dtype=torch.bfloat16).requires_grad_(False)
    if layout == "linear4bit":
        return linear4bit_experts_from(stock, quant_type="nf4", blocksize=64, compress_statistics=True)
    leantrain.quantize_experts_4bit(stock, compress_statistics=True)
    return stock


def _plans(module: torch.nn.Module, layout: str) -> dict[str, _grouped.ExpertsPlan]:
    plan, _ = build_plan(Found("experts", module, layout), Undo().push, recompute=True)
    return {kernel: dataclasses.replace(plan, kernel=kernel) for kernel in _grouped.KERNELS}


def _inputs(tokens: int, experts: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, experts, device=device, dtype=torch.bfloat16, generator=gen)
    idx = logits.topk(4, dim=1).indices
    grad = torch.randn(tokens, H, device=device, dtype=torch.bfloat16, generator=gen)
    return x, logits, idx, grad


def _step(plan, x0, logits0, idx, grad, dense: bool):
    """Output, d/dx and d/d(router logits) of ``<out, grad>``; fresh leaves every call."""
    x, logits = x0.clone().requires_grad_(), logits0.clone().requires_grad_()
    weights = logits.gather(1, idx).softmax(-1)
    if dense:  # the community layout's router returns dense [T, E] scores
        weights = torch.zeros_like(logits).scatter(1, idx, weights)
    out = _grouped.grouped_forward(plan, x, idx, weights)
    out.backward(grad)
    return out.detach(), x.grad, logits.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    "layout,tokens", [("linear4bit", 512), ("linear4bit", 4096), ("stacked", 512)], ids=lambda v: str(v)
)
def test_gpt_oss_layer_fused_matches_dequant_path(cuda, layout, tokens):
    """gpt-oss-20b layer (E=32, top-4, H=I=2880, bf16), fwd + bwd: ``kernel="fused"`` vs the default path, for the
    community Linear4bit layout ([E, out, in], biases, dense routing weights) and 3-D stacks ([E, in, out])."""
    module = _gpt_oss_layer(cuda, 32, layout)
    plans = _plans(module, layout)
    dense = layout == "linear4bit"
    x, logits, idx, grad = _inputs(tokens, 32, cuda)
    ref = _step(plans["dequant"], x, logits, idx, grad, dense)
    ours = _step(plans["fused"], x, logits, idx, grad, dense)
    for name, a, b, factor in zip(("output", "hidden grad", "router grad"), ours, ref, (1, 2, 2)):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.isfinite(a).all(), name
        assert _rel(a, b) <= LAYER_REL * factor, f"{name}: relative error {_rel(a, b):.3g}"


def test_fused_layer_runs_without_host_syncs(cuda):
    """After a warm-up (kernel compile, code-table upload), a fused fwd + bwd issues no synchronizing CUDA call."""
    module = _gpt_oss_layer(cuda, 8, "stacked")
    plan = _plans(module, "stacked")["fused"]
    x, logits, idx, grad = _inputs(256, 8, cuda)
    _step(plan, x, logits, idx, grad, False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(plan, x, logits, idx, grad, False)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("tokens", [512, 4096])
def test_fused_peak_memory_not_above_dequant_path(cuda, tokens):
    """With recompute on (the default), the dequant path still holds one dequantized bf16 stack at a time
    (~1 GB for gate_up); the fused path never writes one, so its peak must not be higher."""
    module = _gpt_oss_layer(cuda, 32, "linear4bit")
    plans = _plans(module, "linear4bit")
    x, logits, idx, grad = _inputs(tokens, 32, cuda)
    peaks = {}
    for kernel in ("dequant", "fused", "dequant"):  # dequant twice: warm caches cannot favour the fused run
        _step(plans[kernel], x, logits, idx, grad, True)  # warm-up (compile, cached casts)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(plans[kernel], x, logits, idx, grad, True)
        torch.cuda.synchronize()
        peaks[kernel] = min(peaks.get(kernel, float("inf")), torch.cuda.max_memory_allocated() - base)
    stack_bytes = 32 * H * 2 * INTER * 2
    assert peaks["fused"] <= peaks["dequant"], peaks
    # The stack really is gone: the gap is not the whole gate_up stack (the two paths free activations at other
    # points of the backward; H100, 2026-11-24/25: gaps of 0.47-0.55 GB beside a 1.06 GB stack), but a path that
    # still wrote a dequantized stack would close it: at least half of the down stack (a quarter of gate_up's).
    assert peaks["dequant"] - peaks["fused"] >= stack_bytes // 4, (peaks, stack_bytes)
