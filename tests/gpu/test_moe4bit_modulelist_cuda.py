"""Grouped 4-bit experts on a transformers 4.x-style sparse MoE block (per-expert ``bnb.nn.Linear4bit`` MLPs) on CUDA:
the replaced block forward against the stock per-expert loop, fp32 (TF32 off) and bf16, with and without the shared
expert, top-2 and top-8, recompute on and off, and the fused-kernel-free default path.

The block is ``testkit.moe4bit_models.SparseMoeBlock4x``: the 4.57 Qwen2/Qwen3-MoE block rebuilt (checked bit-equal
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
from leantrain.moe4bit.registry import LAYOUTS  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import SparseMoeBlock4x, load_in_4bit_like, patch_block_4x  # noqa: E402


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
    assert LAYOUTS["expert_mlps"].reason(b, set()).startswith("SparseMoeBlock4x's forward")  # not a stock class
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


def lora_block(device, dtype, experts: int, top_k: int) -> SparseMoeBlock4x:
    """The block with seeded PEFT LoRA r=16 (random B) on every expert projection and the shared expert, as PEFT
    wraps a 4-bit checkpoint's ``Linear4bit`` (its ``lora.Linear4bit``; adapters in fp32); the router trains."""
    peft = pytest.importorskip("peft")
    b = block(device, dtype, experts, top_k, shared=True)
    cfg = peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)
    peft.inject_adapter_in_model(cfg, b)
    b.gate.weight.requires_grad_(True)
    return b


def run_lora(b: torch.nn.Module, device, dtype, autocast: bool, tokens: int = 96):
    x = torch.randn(2, tokens // 2, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    x.requires_grad_()
    with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
        out, logits = b(x)
    ramp = torch.linspace(-1, 1, out.numel(), device=device).view_as(out).to(out.dtype)
    ((out * ramp).sum() + 1e-3 * logits.float().pow(2).sum()).backward()
    grads = {n: p.grad.clone() for n, p in b.named_parameters() if p.grad is not None}
    b.zero_grad(set_to_none=True)
    return out.detach(), logits.detach(), x.grad, grads


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-autocast"])
def test_block_lora_matches_peft_loop(dev, mode):
    """LoRA on every expert projection: the grouped base and split LoRA against PEFT's per-expert loop, every
    adapter gradient included. fp32 (TF32 off; adapters fp32 as PEFT leaves them): FP32_REL. bf16 blocks: adapters
    in fp32 (x cast up, the output cast back, as PEFT does), or bf16 under autocast (the fast path: the factors are
    cast as PEFT's autocast matmuls cast them): outputs BF16_REL, gradients twice that (norm-wise)."""
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    autocast = mode == "bf16-autocast"
    b = lora_block(dev, dtype, 16, 4)
    stock = run_lora(b, dev, dtype, autocast)
    undo = Undo()
    patch_block_4x(b, undo)
    ours = run_lora(b, dev, dtype, autocast)
    undo()
    bound = FP32_REL if dtype == torch.float32 else BF16_REL
    assert_close(ours[0], stock[0], bound, "output")
    assert torch.equal(ours[1], stock[1]), "router logits"
    assert_close(ours[2], stock[2], 2 * bound, "input grad")
    assert ours[3].keys() == stock[3].keys() and sum("lora_A" in n for n in ours[3]) == 3 * 16 + 3
    for name, grad in ours[3].items():
        assert_close(grad, stock[3][name], 2 * bound, name)
