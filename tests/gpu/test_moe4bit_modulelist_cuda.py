"""Grouped 4-bit experts on a transformers 4.x-style sparse MoE block (per-expert ``bnb.nn.Linear4bit`` MLPs) on CUDA:
the replaced block forward against the stock per-expert loop, fp32 (TF32 off) and bf16, with and without the shared
expert, top-2 and top-8, recompute on and off, and the fused-kernel-free default path.

The block is ``tests._moe4bit_models.SparseMoeBlock4x``: the 4.57 Qwen2/Qwen3-MoE block rebuilt (checked bit-equal
to the real 4.57 classes in tests/parity/test_moe4bit_modulelist.py), so this file runs on transformers 5.x, whose
MoE families have 3-D experts only. Run: ``python3 -m pytest -q -m gpu tests/gpu/test_moe4bit_modulelist_cuda.py``;
dev-only on CPU: ``LEANTRAIN_TEST_DEVICE=cpu python -m pytest -q --noconftest <this file>``.

Tolerances (relative error of whole tensors): as tests/gpu/test_moe4bit_cuda.py. fp32: the loop and the grouped
GEMMs block dot products (K <= 256) differently, about sqrt(K) * eps32 relative; FP32_REL = 256 * eps32 leaves
margin and still catches a wrong expert or weight (O(1) errors). bf16: every GEMM output is rounded to bf16 and
the paths round at different points (the loop adds each expert's output into a bf16 buffer, the grouped path sums in
fp32 and rounds once): a few roundings, BF16_REL = 4 * eps_bf16; gradients pass through twice as many: twice that.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu._device import DEVICE, dev_fixture, needs_device  # noqa: E402, F401 (the "dev" fixture)


pytestmark = needs_device

pytest.importorskip("bitsandbytes")

from leantrain.moe4bit import probe as moe_probe  # noqa: E402
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from tests._moe4bit_models import SparseMoeBlock4x, load_in_4bit_like, patch_block_4x  # noqa: E402


HIDDEN, INTER = 256, 128
FP32_REL = 256 * torch.finfo(torch.float32).eps
BF16_REL = 4 * torch.finfo(torch.bfloat16).eps
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def assert_close(a: torch.Tensor, b: torch.Tensor, bound: float, what: str) -> None:
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: non-finite values"
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g}"


def block(device, dtype, experts: int, top_k: int, shared: bool, double_quant: bool = False) -> SparseMoeBlock4x:
    """Built and quantized on the device, as ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["gate"]))`` would leave it."""
    torch.manual_seed(0)
    b = SparseMoeBlock4x(HIDDEN, INTER, experts, top_k, norm_topk_prob=True, shared_inter=INTER if shared else 0)
    for p in b.parameters():
        torch.nn.init.normal_(p, std=0.05)
    b = b.to(device=device, dtype=dtype)
    load_in_4bit_like(b, skip=("gate",), compute_dtype=dtype, double_quant=double_quant)
    return b.train()


def run(b: torch.nn.Module, device, dtype, tokens: int = 96):
    x = torch.randn(2, tokens // 2, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    x.requires_grad_()
    out, logits = b(x)
    ramp = torch.linspace(-1, 1, out.numel(), device=device).view_as(out).to(dtype)
    ((out * ramp).sum() + 1e-3 * logits.float().pow(2).sum()).backward()
    grad, b.gate.weight.grad = b.gate.weight.grad, None
    return out.detach(), logits.detach(), x.grad, grad


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("experts,top_k,shared,double_quant", [(8, 2, True, False), (16, 8, False, True)])
@pytest.mark.parametrize("recompute", [True, False])
def test_block_matches_stock_loop(dev, dtype, experts, top_k, shared, double_quant, recompute):
    b = block(dev, dtype, experts, top_k, shared, double_quant)
    assert moe_probe.grouped_mm_status(dev, dtype)[0]
    assert moe_probe._expert_mlps_reason(b, set()).startswith("SparseMoeBlock4x's forward")  # not a stock class
    stock = run(b, dev, dtype)
    undo = Undo()
    patch_block_4x(b, undo, recompute=recompute)
    assert "forward" in b.__dict__ and Found("", b, "expert_mlps")
    ours = run(b, dev, dtype)
    undo()
    bound = FP32_REL if dtype == torch.float32 else BF16_REL
    for name, a, s, scale in zip(
        ("output", "router logits", "input grad", "router weight grad"), ours, stock, (1, 0, 2, 2)
    ):
        assert a.dtype == s.dtype and a.device == s.device, name
        if scale == 0:  # the router is the stock module's own call on the same input
            assert torch.equal(a, s), name
        else:
            assert_close(a, s, scale * bound, name)
    assert "forward" not in b.__dict__
    assert torch.equal(run(b, dev, dtype)[0], stock[0])  # unpatched: the stock loop again, consolidation undone
