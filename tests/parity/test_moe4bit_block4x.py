"""The grouped forward on a transformers 4.x-style sparse MoE block on any transformers version: the test-local
``SparseMoeBlock4x`` (the 4.57 Qwen2/Qwen3-MoE block rebuilt; checked against the real 4.57 class in
test_moe4bit_modulelist.py) with per-expert bnb ``Linear4bit`` MLPs, patched as ``Moe4bit.apply`` patches a stock
block. CPU, fp32, seeded; sizes multiples of the 4-bit blocksize (bitsandbytes' CPU dequantize bug, notes §3)."""

from __future__ import annotations

import pytest
import torch


pytest.importorskip("bitsandbytes")

from leantrain.moe4bit import probe as moe_probe  # noqa: E402
from leantrain.moe4bit.registry import find_experts  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import SparseMoeBlock4x, load_in_4bit_like, patch_block_4x  # noqa: E402


HIDDEN, INTER, EXPERTS = 128, 64, 8
EPS = torch.finfo(torch.float32).eps
# Input grad: each pair's [dG dU] @ [W_gate; W_up] is one 2I-term dot product where the loop adds two I-term ones:
# <= 2I * eps * sum|terms| elementwise; norm-wise sum|terms| of random-sign data runs about sqrt(2I) x the result.
INPUT_GRAD_REL = 2 * INTER * EPS * (2 * INTER) ** 0.5


def block(shared: bool, norm: bool, top_k: int = 2) -> SparseMoeBlock4x:
    torch.manual_seed(0)
    b = SparseMoeBlock4x(HIDDEN, INTER, EXPERTS, top_k, norm, shared_inter=INTER if shared else 0)
    for p in b.parameters():
        torch.nn.init.normal_(p, std=0.05)
    load_in_4bit_like(b, skip=("gate",))
    return b.train()


def load_like(layer: torch.nn.Module) -> torch.nn.Module:
    import bitsandbytes.functional as bnbf

    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
    holder.proj.weight.data = bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    load_in_4bit_like(holder)
    return holder.proj


def run(b: torch.nn.Module):
    x = torch.randn(3, 16, HIDDEN, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, logits = b(x)
    ((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + 1e-3 * logits.pow(2).sum()).backward()
    grad, b.gate.weight.grad = b.gate.weight.grad, None
    return out.detach(), logits.detach(), x.grad, grad


@pytest.mark.parametrize("shared,norm,top_k", [(True, False, 2), (False, True, 4), (False, False, 1)])
def test_block4x_fp32_matches_stock_loop(shared, norm, top_k):
    b = block(shared, norm, top_k)
    found = find_experts(b)
    assert [(f.name, f.layout) for f in found] == [("", "expert_mlps")]
    assert "not a stock transformers 4.x MoE block forward" in moe_probe.module_reason(found[0], set())
    stock = run(b)
    undo = Undo()
    patch_block_4x(b, undo)
    ours = run(b)
    undo()
    assert "forward" not in b.__dict__
    for name, a, s in zip(
        ("output", "router logits", "router weight grad"), ours[:2] + ours[3:], stock[:2] + stock[3:]
    ):
        assert torch.equal(a, s), f"{name}: {(a - s).abs().max():.3g}"
    rel = ((ours[2] - stock[2]).norm() / stock[2].norm()).item()
    assert rel <= INPUT_GRAD_REL, rel


@pytest.mark.expect_fallback
def test_block4x_plan_check_sends_a_moved_block_to_the_loop():
    """An expert replaced after patching fails the per-call check: the (non-strict) fallback serves the stock loop."""
    b = block(True, False)
    stock = run(b)
    undo = Undo()
    patch_block_4x(b, undo, strict=False)
    b.experts[-1].down_proj = b.experts[-1].down_proj  # same module: still served
    first = b.experts[0]
    first.gate_proj = load_like(first.gate_proj)  # a new module holding the same weights: the check refuses
    with pytest.warns(RuntimeWarning, match="moved, cast, reloaded or replaced"):
        ours = run(b)
    undo()
    for a, s in zip(ours, stock):
        assert torch.equal(a, s)


RANK = 8
# With adapters on every expert projection the input gradient also adds each adapter's input gradient in another
# order (2r + 4 more terms in the reassociation bound).
LORA_INPUT_GRAD_REL = (2 * INTER + 2 * RANK + 4) * EPS * (2 * INTER) ** 0.5


def lora_block(shared: bool, top_k: int = 2) -> SparseMoeBlock4x:
    """The block with seeded PEFT LoRA (random B) on every expert projection (and the shared expert's), as a 4-bit
    checkpoint loads it (PEFT's lora.Linear4bit); the router trains."""
    peft = pytest.importorskip("peft")
    b = block(shared, False, top_k)
    cfg = peft.LoraConfig(
        r=RANK, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)
    peft.inject_adapter_in_model(cfg, b)
    b.gate.weight.requires_grad_(True)
    return b


def run_lora(b: torch.nn.Module):
    """(output, router logits, input grad, {name: grad} of the router and every adapter)."""
    x = torch.randn(3, 16, HIDDEN, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, logits = b(x)
    ((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + 1e-3 * logits.pow(2).sum()).backward()
    grads = {n: p.grad.clone() for n, p in b.named_parameters() if p.grad is not None}
    b.zero_grad(set_to_none=True)
    return out.detach(), logits.detach(), x.grad, grads


@pytest.mark.parametrize("shared,top_k", [(True, 2), (False, 4)])
def test_block4x_lora_matches_peft_loop(shared, top_k):
    """fp32, LoRA on every expert's gate, up and down: the grouped base and split LoRA against PEFT's per-expert loop.
    The adapters' GEMMs are the loop's per-expert matmuls on the same rows (CPU grouped_mm: one mm per group), so the
    output, router logits and router gradient are bit-identical; each adapter gradient is one per-expert GEMM over
    the expert's rows in the other operand order, at most one reordering of its 48 rows' sum; the input gradient as
    above (LORA_INPUT_GRAD_REL, norm-wise)."""
    b = lora_block(shared, top_k)
    stock = run_lora(b)
    undo = Undo()
    patch_block_4x(b, undo)
    ours = run_lora(b)
    undo()
    assert "forward" not in b.__dict__
    for name, a, s in zip(("output", "router logits"), ours[:2], stock[:2]):
        assert torch.equal(a, s), f"{name}: {(a - s).abs().max():.3g}"
    assert ((ours[2] - stock[2]).norm() / stock[2].norm()).item() <= LORA_INPUT_GRAD_REL
    assert ours[3].keys() == stock[3].keys()
    assert sum(n.startswith("experts.") and "lora_B" in n for n in ours[3]) == 3 * EXPERTS
    assert torch.equal(ours[3]["gate.weight"], stock[3]["gate.weight"])
    for name, grad in ours[3].items():
        scale = stock[3][name].abs().max().item()
        assert (grad - stock[3][name]).abs().max().item() <= 48 * EPS * scale, name
