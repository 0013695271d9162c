"""LoRA on 4-bit experts on CUDA: split LoRA as grouped GEMMs against a per-expert loop (output, dX, dA, dB; empty
experts, padded small ranks, Qwen3-30B-A3B-sized groups) and whole tiny models through ``patch_trainer`` against
PEFT's per-expert result (``target_parameters`` on 4-bit stacks, LoRA on per-expert ``Linear4bit``), bf16 and fp32.

Run: ``python3 -m pytest -q -m gpu tests/gpu/test_moe4bit_lora_cuda.py`` (an H100: the bf16 grouped GEMMs take
CUTLASS's fast path there, including the 2-D x 2-D weight-gradient form with empty groups, pytorch#152668).
Dev-only: ``LEANTRAIN_TEST_DEVICE=cpu python -m pytest -q --noconftest tests/gpu/test_moe4bit_lora_cuda.py``.

Tolerances (relative error of whole tensors, ``||a - b|| / ||b||``, against an fp32 per-expert reference computed
from the same bf16 values): bf16 split LoRA rounds x·A to bf16 once and the output once, each a relative eps/2
per element: ``4 * eps_bf16`` leaves margin and still catches a wrong expert or scale (O(1) errors); gradients pass
two more roundings: twice that. Whole models: as tests/gpu/test_moe4bit_cuda.py (bf16: 4 eps outputs, 8 eps grads).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tests.gpu._device import DEVICE, dev_fixture, needs_device  # noqa: E402, F401 (the "dev" fixture)


pytestmark = needs_device

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

import leantrain  # noqa: E402
from leantrain.moe4bit.lora import LoraFactors, split_lora  # noqa: E402
from leantrain.report import Status  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402
from tests import _moe4bit_lora as parity  # noqa: E402


BF16_REL = 4 * torch.finfo(torch.bfloat16).eps
FP32_REL = 256 * torch.finfo(torch.float32).eps
ONLY_MOE = others_off("moe4bit")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_close(a: torch.Tensor, b: torch.Tensor, bound: float, what: str) -> None:
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: non-finite values"
    err = _rel(a, b)
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g}"


def loop_lora(x, a, b, offs, scaling):
    parts, start = [], 0
    for e, end in enumerate(offs.tolist()):
        parts.append((x[start:end] @ a[e].t()) @ b[e].t() * scaling)
        start = end
    return torch.cat(parts)


@pytest.mark.parametrize(
    "experts,rows_per,inp,out,rank",
    [(8, 37, 256, 512, 16), (8, 37, 256, 512, 4), (128, 64, 2048, 1536, 16)],  # the last: Qwen3-30B-A3B gate_up
)
def test_split_lora_bf16_vs_loop(dev, experts, rows_per, inp, out, rank):
    gen = torch.Generator(device="cpu").manual_seed(rank)
    sizes = torch.randint(0, 2 * rows_per, (experts,), generator=gen)
    sizes[1] = 0  # an empty expert: zero dA / dB, and the weight-gradient GEMM sees K = 0
    offs = sizes.cumsum(0).to(torch.int32).to(dev)
    x = torch.randn(int(sizes.sum()), inp, generator=gen).to(dev, torch.bfloat16)
    a = (torch.randn(experts, rank, inp, generator=gen) * inp**-0.5).to(dev, torch.bfloat16)
    b = (torch.randn(experts, out, rank, generator=gen) * rank**-0.5).to(dev, torch.bfloat16)
    gy = torch.randn(x.shape[0], out, generator=gen).to(dev, torch.bfloat16)
    ours = [t.detach().clone().requires_grad_() for t in (x, a, b)]
    y = split_lora(ours[0], LoraFactors(ours[1], ours[2], 2.0), offs)
    y.backward(gy)
    ref = [t.detach().float().requires_grad_() for t in (x, a, b)]
    y_ref = loop_lora(*ref, offs, 2.0)
    y_ref.backward(gy.float())
    assert y.dtype == torch.bfloat16
    assert_close(y.float(), y_ref, BF16_REL, "output")
    for name, o, r in zip(("dX", "dA", "dB"), ours, ref):
        assert_close(o.grad.float(), r.grad, 2 * BF16_REL, name)
    assert torch.equal(ours[1].grad[1], torch.zeros_like(ours[1].grad[1]))  # the empty expert
    assert torch.equal(ours[2].grad[1], torch.zeros_like(ours[2].grad[1]))


def trainer_on(model, dev, tmp_path) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=dev.type == "cpu", max_steps=1
    )
    return transformers.Trainer(model=model, args=args, train_dataset=[parity.batch(1)["input_ids"][0]] * 2)


def step(model, dev):
    model.zero_grad(set_to_none=True)
    loss = model(**{k: v.to(dev) for k, v in parity.batch().items()}).loss
    loss.backward()
    keys = parity._keys(model)
    return loss.detach(), {keys.get(id(p), n): p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_stacked_target_parameters_vs_peft(dev, dtype, tmp_path):
    quantized, plain = parity.stacked_pair("qwen3_moe", dtype)
    quantized, plain = quantized.to(dev), plain.to(dev)
    parity.routers_trainable(quantized), parity.routers_trainable(plain)
    exact = copy.deepcopy(plain).float()  # the same (bf16-rounded) weights in fp32: what both bf16 runs estimate
    ref_loss, ref_grads = step(plain, dev)
    _, exact_grads = step(exact, dev)
    trainer = trainer_on(quantized, dev, tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
    assert report["moe4bit"].status is Status.APPLIED, report["moe4bit"].reasons
    loss, grads = step(quantized, dev)
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED
    bound = BF16_REL if dtype == torch.bfloat16 else FP32_REL
    assert_close(loss.float(), ref_loss.float(), bound, "loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        if dtype == torch.float32:
            assert_close(grad, ref_grads[name], 2 * bound, name)
            continue
        # bf16: grouped and per-expert GEMMs sum in other orders, and a gradient summed over many tokens with
        # cancellation can differ between the two by more than a few eps; each must estimate the fp32 gradient of
        # the same weights as well as the other (within a factor 2, plus eps of rounding the result itself).
        ours, peft_err = _rel(grad, exact_grads[name]), _rel(ref_grads[name], exact_grads[name])
        assert ours <= 2 * peft_err + bound, f"{name}: bf16 error {ours:.3g} vs PEFT's {peft_err:.3g}"
    with quantized.disable_adapter():
        quantized(**{k: v.to(dev) for k, v in parity.batch().items()}).loss.backward()  # base-only path runs
    leantrain.unpatch_trainer(trainer)


def test_linear4bit_lists_vs_peft_loop(dev, tmp_path):
    ref_model = parity.lists_model("gpt_oss").to(dev)
    model = parity.lists_model("gpt_oss").to(dev)  # the same seeds: the same weights and adapters
    ref_loss, ref_grads = step(ref_model, dev)
    trainer = trainer_on(model, dev, tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
    assert report["moe4bit"].status is Status.APPLIED, report["moe4bit"].reasons
    loss, grads = step(model, dev)
    assert_close(loss, ref_loss, FP32_REL, "loss")
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], 2 * FP32_REL, name)
    leantrain.unpatch_trainer(trainer)
