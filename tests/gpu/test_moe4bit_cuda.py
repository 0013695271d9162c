"""Grouped 4-bit MoE experts on CUDA: both layouts, quantized before and after the move to the device, fp32 and bf16,
whole tiny-model training steps through the Trainer's own device placement, state-dict round trips, moves back and
forth, moved-after-patching fallback, and dequantized stacks bitwise equal to bitsandbytes' ``dequantize_4bit``.

Issue #10, defect 1: a model quantized on CPU and moved to CUDA dequantized with host pointers (illegal memory
access). Run: ``python3 -m pytest -q -m gpu tests/gpu/test_moe4bit_cuda.py``.

Dev-only: ``LEANTRAIN_TEST_DEVICE=cpu python -m pytest -q --noconftest tests/gpu/test_moe4bit_cuda.py`` runs this
file's logic on CPU (``--noconftest`` because the gpu conftest skips without CUDA, and the root conftest clears
``LEANTRAIN_*``; a normal run never sees the variable, so it cannot make the suite vacuous).

Tolerances (relative error of whole tensors, ``||a - b|| / ||b||``): the grouped path and the per-expert loop do the
same math with different GEMM blockings. fp32 (TF32 off): each dot product of length K <= 256 is off by about
sqrt(K) * eps32 ~ 2e-6 relative; ``FP32_REL = 256 * eps32`` (3e-5) leaves 15x margin and still catches any wrong
expert, bias or weight (O(1) errors). bf16: every GEMM output is rounded to bf16 (relative eps/2 per element) and
the two paths round at different points (bias added before/after rounding, combine in fp32 vs bf16): a few
roundings, ``BF16_REL = 4 * eps_bf16`` (3.1e-2) for outputs; gradients pass through twice as many roundings:
twice the bound.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

from tests.gpu._device import DEVICE, dev_fixture, needs_device  # noqa: E402, F401 (the "dev" fixture)


pytestmark = needs_device

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbf  # noqa: E402

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model  # noqa: E402
from leantrain.moe4bit import ops, readiness  # noqa: E402
from leantrain.moe4bit._stacks import STACK_NAMES, state_tensors  # noqa: E402
from leantrain.moe4bit.layout_stacked import live_stacked_plan  # noqa: E402
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.moe4bit.registry import build_plan  # noqa: E402
from leantrain.report import Status  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import convert_model_to_linear4bit_experts  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402
from tests import _moe4bit_experts as parity  # noqa: E402


HIDDEN = parity.HIDDEN  # the experts' sizes (parity.stock_experts): multiples of the blocksize
T, VOCAB = 40, 256
FP32_REL = 256 * torch.finfo(torch.float32).eps
BF16_REL = 4 * torch.finfo(torch.bfloat16).eps
ONLY_MOE = others_off("moe4bit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rel(dtype: torch.dtype, grads: bool = False) -> float:
    return (FP32_REL if dtype == torch.float32 else BF16_REL) * (2 if grads else 1)


def assert_close(a: torch.Tensor, b: torch.Tensor, bound: float, what: str) -> None:
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: non-finite values"
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g}"


def all_on(tensors, device: torch.device) -> None:
    wrong = {name: t.device for name, t in tensors.items() if t.device.type != device.type}
    assert not wrong, f"not on {device}: {wrong}"


# ------------------------------------------------------------------------------------------------- one module


def stock_experts(family: str, num_experts: int = 6) -> torch.nn.Module:
    """Stock transformers experts (eager loop), random weights large enough to exercise gpt-oss's clamp."""
    return parity.stock_experts(family, num_experts)


def four_bit(layout: str, stock: torch.nn.Module, nested: bool = True) -> torch.nn.Module:
    """Quantized where ``stock`` lives (bitsandbytes quantizes Linear4bit on its first move to a device)."""
    return parity.four_bit(layout, stock, nested)


def module_tensors(layout: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Packed data, every quantization-state tensor and bias of an experts module, by name."""
    found = {}
    if layout == "stacked":
        for name in STACK_NAMES:
            plist = module.parametrizations[name]
            found[name] = plist.original
            found.update({f"{name}.{k}": t for k, t in state_tensors(plist[0].quant_state).items()})
    else:
        for lists in ("gate_up_projs", "down_projs"):
            for e, layer in enumerate(getattr(module, lists)):
                found[f"{lists}.{e}"] = layer.weight
                found.update({f"{lists}.{e}.{k}": t for k, t in state_tensors(layer.weight.quant_state).items()})
    found.update({n: b for n, b in module.named_parameters() if "bias" in n})
    return found


def inputs(dev: torch.device, dtype: torch.dtype, num_experts: int = 6, top_k: int = 2):
    gen = torch.Generator().manual_seed(1)
    x, logits = torch.randn(T, HIDDEN, generator=gen), torch.randn(T, num_experts, generator=gen)
    logits[:, 0] = -9.0  # expert 0 gets no token
    idx = logits.topk(top_k, dim=1).indices
    return x.to(dev, dtype), logits.to(dev, dtype), idx.to(dev)


def run(fn, x0, logits0, idx):
    """Output, d(loss)/d(hidden), d(loss)/d(router logits)."""
    x, logits = x0.clone().requires_grad_(), logits0.clone().requires_grad_()
    out = fn(x, idx, logits.gather(1, idx).softmax(-1))
    probe = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype)
    (out * probe).sum().backward()
    return out.detach(), x.grad, logits.grad


def grouped(layout: str, module: torch.nn.Module):
    plan, check = build_plan(Found("experts", module, layout), Undo().push, recompute=True)

    def fn(x, idx, w):
        check(x, idx, w)
        return ops.grouped_forward(plan, x, idx, w)

    return fn


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("when", ["quantize_then_move", "move_then_quantize"])
@pytest.mark.parametrize("layout,family", [("stacked", "qwen3_moe"), ("linear4bit", "gpt_oss")])
def test_module_quantized_before_or_after_the_move(layout, family, when, dtype, dev):
    """Every packed/state/bias tensor ends up on the device, and the grouped path matches the layout's stock path
    (HF eager on the dequantizing parametrization, or the per-expert Linear4bit loop) in output and gradients."""
    stock = stock_experts(family).to(dtype)
    if when == "quantize_then_move":
        module = four_bit(layout, stock).to(dev)
    else:
        module = four_bit(layout, stock.to(dev))
    all_on(module_tensors(layout, module), dev)
    assert readiness(module).ready, readiness(module).reasons
    x, logits, idx = inputs(dev, dtype)
    loop = run(module, x, logits, idx)
    ours = run(grouped(layout, module), x, logits, idx)
    for name, a, b in zip(("output", "hidden grad", "router grad"), ours, loop):
        assert a.dtype == dtype and a.device.type == dev.type, name
        assert_close(a, b, rel(dtype, grads=name != "output"), name)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_per_call_plan_matches_the_stock_path(family, dtype, dev):
    """The FSDP2 plan (rebuilt per call around the module's live stacks) on the device: the same outputs and
    gradients as the stock path, and bitwise the fixed plan's (same tensors, same kernels)."""
    module = four_bit("stacked", stock_experts(family).to(dtype)).to(dev)
    plan_for = live_stacked_plan(module, recompute=True)
    x, logits, idx = inputs(dev, dtype)
    loop = run(module, x, logits, idx)
    live = run(lambda x, idx, w: ops.grouped_forward(plan_for(x, idx, w), x, idx, w), x, logits, idx)
    fixed = run(grouped("stacked", module), x, logits, idx)
    for name, a, b, c in zip(("output", "hidden grad", "router grad"), live, loop, fixed):
        assert_close(a, b, rel(dtype, grads=name != "output"), name)
        assert torch.equal(a, c), name


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("layout", ["stacked", "linear4bit"])
def test_dequantized_stack_bitwise_equals_bitsandbytes(layout, nested, dev):
    """The grouped path's one-call stack dequantize equals bitsandbytes' ``dequantize_4bit`` of the same data,
    for a module quantized on CPU and then moved (the defect's path)."""
    module = four_bit(layout, stock_experts("gpt_oss"), nested).to(dev)
    plan, _ = build_plan(Found("experts", module, layout), Undo().push, recompute=True)
    for dtype in DTYPES.values():
        if layout == "stacked":
            plist = module.parametrizations.gate_up_proj
            plist[0].quant_state.dtype = dtype
            expected = bnbf.dequantize_4bit(plist.original, plist[0].quant_state)
        else:
            expected = []
            for lin in module.gate_up_projs:
                qs = copy.copy(lin.weight.quant_state)
                qs.dtype = dtype
                expected.append(bnbf.dequantize_4bit(lin.weight.data, qs))
            expected = torch.stack(expected)
        got = plan.gate_up.stack.dequantize(dtype)
        assert got.device.type == dev.type and torch.equal(got, expected), dtype


@pytest.mark.parametrize("layout", ["stacked", "linear4bit"])
def test_move_back_and_forth(layout, dev):
    """device -> cpu -> device: every tensor follows, outputs are bitwise those before the trip."""
    module = four_bit(layout, stock_experts("gpt_oss").to(dev))
    x, logits, idx = inputs(dev, torch.float32)
    before = run(module, x, logits, idx)
    module.to("cpu")
    all_on(module_tensors(layout, module), torch.device("cpu"))
    module.to(dev)
    all_on(module_tensors(layout, module), dev)
    for a, b in zip(run(module, x, logits, idx), before):
        assert torch.equal(a, b)
    ours = run(grouped(layout, module), x, logits, idx)
    assert_close(ours[0], before[0], FP32_REL, "grouped output after the trip")


@pytest.mark.parametrize("nested", [False, True])
def test_state_dict_round_trip_on_device(nested, dev):
    """state_dict of a model quantized on the device -> load into a model quantized on CPU with other weights and
    moved: same tensors (on the device), same outputs."""
    source = four_bit("stacked", stock_experts("qwen3_moe").to(dev), nested)
    other = stock_experts("qwen3_moe")
    with torch.no_grad():
        other.gate_up_proj.mul_(-1)
    target = four_bit("stacked", other, nested).to(dev)
    target.load_state_dict(source.state_dict())
    src, tgt = module_tensors("stacked", source), module_tensors("stacked", target)
    all_on(tgt, dev)
    for name, t in tgt.items():
        assert torch.equal(t, src[name]), name
    x, logits, idx = inputs(dev, torch.float32)
    for a, b in zip(run(target, x, logits, idx), run(source, x, logits, idx)):
        assert torch.equal(a, b)


def test_probe_and_guard_decline_a_device_mix(dev):
    """One absmax left behind: the probe declines with the tensor's name and both devices; the per-call guard
    refuses inputs on another device before any kernel runs."""
    away = "cpu" if dev.type != "cpu" else "meta"
    module = four_bit("stacked", stock_experts("qwen3_moe"), True).to(dev)
    x, logits, idx = inputs(dev, torch.float32)
    fn = grouped("stacked", module)
    with pytest.raises(RuntimeError, match="experts on"):
        fn(x.to(away), idx, logits.gather(1, idx))
    qs = module.parametrizations.down_proj[0].quant_state
    qs.state2.absmax = qs.state2.absmax.to(away)
    (reason,) = readiness(module).reasons
    assert "different devices (down_proj nested_absmax on " + away in reason, reason


# --------------------------------------------------------------------------------------------- whole models


def model_step(family: str, layout: str, dtype: torch.dtype, dev: torch.device, patch: bool, tmp_path):
    """Quantize on CPU, cast, let the Trainer place the model (what users do), optionally patch, one forward +
    backward. Returns the loss, the trainable gradients and the trainer."""
    model = tiny_model(family, seed=0, hidden=HIDDEN, layers=2, vocab_size=VOCAB)
    model.set_experts_implementation("eager")
    if layout == "stacked":
        leantrain.quantize_experts_4bit(model)
    else:
        convert_model_to_linear4bit_experts(model)
    model.to(dtype).train()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=dev.type == "cpu", report_to=[], save_strategy="no", seed=0
    )
    trainer = transformers.Trainer(model=model, args=args)
    experts = model.model.layers[0].mlp.experts
    all_on(module_tensors(layout, experts), dev)  # the Trainer's own placement moved every state tensor
    if patch:
        report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
        assert report["moe4bit"].status is Status.APPLIED, report["moe4bit"].reasons
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0)).to(dev)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if patch:
        assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED  # no silent fallback
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, trainer


@pytest.mark.parametrize(
    "family,layout,dtype",
    [
        ("gpt_oss", "stacked", torch.float32),
        ("gpt_oss", "stacked", torch.bfloat16),
        ("qwen3_moe", "stacked", torch.float32),
        ("qwen3_moe", "stacked", torch.bfloat16),
        ("gpt_oss", "linear4bit", torch.float32),
    ],
)
def test_model_step_patched_vs_stock(family, layout, dtype, dev, tmp_path):
    """A whole tiny model quantized on CPU and placed by the Trainer: patched loss and every trainable gradient
    (router included) match the stock per-expert loop."""
    stock_loss, stock_grads, _ = model_step(family, layout, dtype, dev, False, tmp_path / "stock")
    loss, grads, trainer = model_step(family, layout, dtype, dev, True, tmp_path / "patched")
    assert_close(loss, stock_loss, rel(dtype), "loss")
    assert grads.keys() == stock_grads.keys() and any("router" in n or "gate.weight" in n for n in grads)
    for name, grad in grads.items():
        assert_close(grad, stock_grads[name], rel(dtype, grads=True), name)
    leantrain.unpatch_trainer(trainer)


@pytest.mark.expect_fallback
@pytest.mark.parametrize("layout", ["stacked", "linear4bit"])
def test_patched_model_moved_after_patching_falls_back_once(layout, dev, tmp_path):
    """Patched on the device, then moved away and back: one run-time warning, the stock path from then on (no
    kernel ever sees the stale buffers), outputs equal an unpatched model's; a no-op move keeps the fast path."""
    if dev.type == "cpu":
        pytest.skip("needs a second device to move to and back")
    family = "qwen3_moe" if layout == "stacked" else "gpt_oss"
    _, _, trainer = model_step(family, layout, torch.float32, dev, True, tmp_path)
    model = trainer.model
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2)).to(dev)
    model.to(dev)  # already there: no fallback
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids)
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED
    model.to("cpu").to(dev)
    with pytest.warns(RuntimeWarning, match="moved, cast, reloaded or replaced after patching"):
        out = model(input_ids=ids).logits
    with warnings.catch_warnings(record=True) as caught_again:
        warnings.simplefilter("always")
        again = model(input_ids=ids).logits
    assert not [w for w in caught + caught_again if "leantrain" in str(w.message)]
    assert torch.equal(out, again)
    leantrain.unpatch_trainer(trainer)
    assert torch.equal(model(input_ids=ids).logits, out)  # the stock path before and after unpatching
