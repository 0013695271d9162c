"""moe4bit's grouped 4-bit experts inside compiled decoder layers on CUDA (inductor, bf16): a tiny Qwen3-MoE with
``quantize_experts_4bit`` stacks, three batches of loss and gradients, compiled against eager moe4bit and against the
stock CUDA per-expert loop, and one compiled code for both layers and every batch.

Bounds (u = bf16's unit roundoff, 2^-8; relative errors of whole tensors, ``||a - b|| / ||b||``): inductor fuses
the norms, activations and casts around the opaque custom ops and keeps fused intermediates in fp32, so it moves
rounding points without adding error of its own (``emulate_precision_casts`` makes it round where eager rounds,
which keeps both runs on the same routing: a router logit moved by one rounding can change a token's top-k choice).
Compiled vs eager moe4bit: the same kernels for the experts and the same cuBLAS GEMMs elsewhere, a few roundings
apart per layer: the loss within 4u relative, each gradient within 8u. Compiled vs the stock loop: that plus the
grouped path's own distance from the loop (tests/gpu/test_moe4bit_cuda.py: 4 bf16 eps = 8u for outputs, twice for
gradients): the loss within 12u, each gradient within 24u. Any wrong expert, bias, routing weight or stale stack is
an O(1) error."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import Status
from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers import stats
from testkit.optimizations import others_off


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
bnb = pytest.importorskip("bitsandbytes")

VOCAB, SEQ = 256, 32
U = 2.0**-8


def patched(device: torch.device, tmp_path, moe4bit: bool, compiled: bool, router: bool = False):
    """The tiny 4-bit Qwen3-MoE (bf16 compute) and its trainer, patched with moe4bit and/or compile_layers only;
    ``router``: the model returns its router logits (TRL's load-balancing loss) and checkpoints its layers."""
    model = tiny_model("qwen3_moe", seed=0, hidden=128, layers=2, vocab_size=VOCAB, dtype=torch.bfloat16)
    model.set_experts_implementation("eager")  # the stock per-expert loop
    leantrain.quantize_experts_4bit(model)
    model = model.to(device).train()
    if router:
        model.config.get_text_config().output_router_logits = True
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], save_strategy="no", seed=0,
                             per_device_train_batch_size=2, max_steps=3, disable_tqdm=True)  # fmt: skip
    ids = torch.randint(3, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r.clone()} for r in ids])
    options = {**others_off("moe4bit"), "moe4bit": moe4bit, "compile_layers": compiled}
    report = leantrain.patch_trainer(trainer, strict=True, **options)
    assert report["moe4bit"].status is (Status.APPLIED if moe4bit else Status.DISABLED), report
    assert report["compile_layers"].status is (Status.APPLIED if compiled else Status.DISABLED), report
    return model, trainer


def run(model, device: torch.device) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Loss and every gradient (fp32 copies) for three batches, three routings."""
    out = []
    for seed in range(3):
        ids = torch.randint(3, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(seed)).to(device)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss.detach().float(), grads))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_close_runs(runs, reference, loss_bound: float, grad_bound: float, what: str) -> None:
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(runs, reference, strict=True)):
        assert rel(loss, ref_loss) <= loss_bound, f"{what}, batch {step}: loss {loss.item()} vs {ref_loss.item()}"
        assert grads.keys() == ref_grads.keys() and any("mlp.gate" in n for n in ref_grads)  # the router's too
        for name, grad in ref_grads.items():
            err = rel(grads[name], grad)
            assert err <= grad_bound, f"{what}, batch {step}: {name} relative error {err:.3g} > {grad_bound:.3g}"


@pytest.mark.parametrize("router", [False, True])
def test_compiled_moe4bit_layers_match_eager_and_stock_with_one_compile(router, cuda, tmp_path):
    """``router``: with the router logits captured (the loss adds the load-balancing term) and checkpointing on."""
    stock = run(patched(cuda, tmp_path / "stock", moe4bit=False, compiled=False, router=router)[0], cuda)
    eager = run(patched(cuda, tmp_path / "eager", moe4bit=True, compiled=False, router=router)[0], cuda)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        model, trainer = patched(cuda, tmp_path / "compiled", moe4bit=True, compiled=True, router=router)
        compiled = run(model, cuda)
    assert_close_runs(compiled, eager, 4 * U, 8 * U, "compiled vs eager moe4bit")
    assert_close_runs(compiled, stock, 12 * U, 24 * U, "compiled vs the stock loop")
    assert stats(trainer).compiles == 1  # two layers, three routings: one compiled code
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED  # no run-time fallback
