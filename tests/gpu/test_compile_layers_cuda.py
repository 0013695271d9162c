"""Compiled decoder layers on CUDA (inductor, the default backend) against the stock CUDA layers, in bf16 autocast:
tiny Llama / Qwen2 / Gemma-2 with LoRA and gradient checkpointing, QLoRA (bitsandbytes 4-bit linears inside the
layers), and batches of varying width (recompiles bounded).

Bounds (u = bf16's unit roundoff, 2^-8): the stock bf16 run and the compiled one both approximate the fp32 run;
inductor fuses the norms, activations and casts and keeps fused intermediates in fp32, so it moves rounding points
without adding error of its own: at every logged step the compiled loss may be at most twice as far from the fp32
loss as the stock bf16 loss is, plus four bf16 roundings of the loss (``2·|stock - fp32| + 4u·|fp32|``). QLoRA has no
fp32 twin (the 4-bit weights are the model): there both bf16 runs dequantize the same blocks, and the compiled loss
stays within 8u relative of the stock one (two bf16 roundings per layer output over two layers, averaged by the
mean over tokens)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import Status
from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers import stats
from testkit.batches import pad_right, random_rows
from testkit.optimizations import only


pytestmark = pytest.mark.gpu
VOCAB = 512
U = 2.0**-8


def rows(n: int, lengths: tuple[int, ...]) -> list[dict[str, list[int]]]:
    return random_rows(n, lengths, VOCAB)


pad = pad_right


def lora_model(family: str, device: torch.device) -> torch.nn.Module:
    import peft

    model = tiny_model(family, vocab_size=VOCAB, hidden=128, layers=2).to(device).train()
    torch.manual_seed(1)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    return peft.get_peft_model(model, config)


def train(model, tmp_path, patch: dict | None, data, bf16: bool = True, reentrant: bool = False, steps: int = 4):
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], save_strategy="no", learning_rate=1e-3, bf16=bf16,
        per_device_train_batch_size=2, max_steps=steps, logging_steps=1, disable_tqdm=True, seed=0,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=pad)
    if patch is not None:
        leantrain.patch_trainer(trainer, **{**only("compile_layers"), **patch})
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def assert_within_bf16_bound(compiled: list[float], stock: list[float], fp32: list[float]) -> None:
    for step, (c, s, f) in enumerate(zip(compiled, stock, fp32, strict=True)):
        bound = 2 * abs(s - f) + 4 * U * abs(f)
        assert abs(c - f) <= bound, f"step {step}: compiled {c} vs fp32 {f} (stock bf16 {s}), bound {bound:.3g}"


@pytest.mark.parametrize(("family", "reentrant"), [("llama", False), ("llama", True), ("qwen2", False),
                                                   ("gemma2", False)])  # fmt: skip
def test_lora_with_checkpointing_trains_as_stock(family, reentrant, cuda, tmp_path):
    pytest.importorskip("peft")
    data = rows(8, (32,))
    fp32, _ = train(lora_model(family, cuda), tmp_path, None, data, bf16=False, reentrant=reentrant)
    stock, _ = train(lora_model(family, cuda), tmp_path, None, data, reentrant=reentrant)
    compiled, trainer = train(lora_model(family, cuda), tmp_path, {"compile_layers": True}, data, reentrant=reentrant)
    assert trainer.leantrain_report["compile_layers"].status is Status.APPLIED, trainer.leantrain_report
    assert_within_bf16_bound(compiled, stock, fp32)
    assert stats(trainer).compiles <= 2  # one code for both layers (reentrant: maybe a no-grad entry too)


@pytest.mark.parametrize("reentrant", [False, True])
def test_elementwise_recompute_trains_as_stock(reentrant, cuda, tmp_path):
    """compile_layers_recompute="elementwise" on inductor/CUDA: the recomputed norms and activations may round
    differently from the saved ones (other fused kernels), so the same bf16 bound as the default compile."""
    pytest.importorskip("peft")
    data = rows(8, (32,))
    patch = {"compile_layers": True, "compile_layers_recompute": "elementwise"}
    fp32, _ = train(lora_model("llama", cuda), tmp_path, None, data, bf16=False, reentrant=reentrant)
    stock, _ = train(lora_model("llama", cuda), tmp_path, None, data, reentrant=reentrant)
    compiled, trainer = train(lora_model("llama", cuda), tmp_path, patch, data, reentrant=reentrant)
    outcome = trainer.leantrain_report["compile_layers"]
    assert outcome.status is Status.APPLIED and "elementwise ops recomputed" in outcome.detail, outcome
    assert_within_bf16_bound(compiled, stock, fp32)


@pytest.mark.parametrize("dynamic", ["auto", "always"])
def test_varying_lengths_stay_compiled(dynamic, cuda, tmp_path):
    pytest.importorskip("peft")
    data = rows(16, (40, 97, 64, 128, 71, 33, 110, 52))
    patch = {"compile_layers": True, "compile_layers_dynamic": dynamic}
    fp32, _ = train(lora_model("llama", cuda), tmp_path, None, data, bf16=False, steps=8)
    stock, _ = train(lora_model("llama", cuda), tmp_path, None, data, steps=8)
    compiled, trainer = train(lora_model("llama", cuda), tmp_path, patch, data, steps=8)
    assert trainer.leantrain_report["compile_layers"].status is Status.APPLIED, trainer.leantrain_report
    assert stats(trainer).recompiles <= 1
    assert_within_bf16_bound(compiled, stock, fp32)


def qlora_model(tmp_path, device: torch.device) -> torch.nn.Module:
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = tmp_path / "tiny"
    tiny_model("llama", vocab_size=VOCAB, hidden=128, layers=2).save_pretrained(path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map={"": device.index or 0})
    torch.manual_seed(1)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    return peft.get_peft_model(model, config)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
@pytest.mark.parametrize("recompute", ["default", "elementwise"])
def test_qlora_trains_as_stock(recompute, cuda, tmp_path):
    pytest.importorskip("peft")
    data = rows(8, (32,))
    patch = {"compile_layers": True, "compile_layers_recompute": recompute}
    stock, _ = train(qlora_model(tmp_path, cuda), tmp_path, None, data)
    compiled, trainer = train(qlora_model(tmp_path, cuda), tmp_path, patch, data)
    outcome = trainer.leantrain_report["compile_layers"]
    assert outcome.status is Status.APPLIED, outcome
    for step, (c, s) in enumerate(zip(compiled, stock, strict=True)):
        assert abs(c - s) <= 8 * U * abs(s), f"step {step}: compiled {c} vs stock {s}"


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_lora_scaling_on_the_rank_side_gives_the_same_bits(quantized, compiled, cuda, tmp_path):
    """The LoRA forwards compile_layers binds (scaling 16 / 8 = 2 on the rank-r side) against PEFT's, for its plain
    (as two GEMMs; test_one_gemm_lora_cuda.py bounds the one-GEMM form) and its bitsandbytes 4-bit LoRA linear, in
    bf16 autocast on CUDA, eager and compiled by inductor: output and gradients equal bit for bit (scaling by a
    power of two commutes with every rounding, so no fusion choice can move a bit)."""
    from leantrain.compile_layers.ops import lora4bit_scaled_on_rank, lora_two_gemms

    if quantized and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes not installed")
    model = qlora_model(tmp_path, cuda) if quantized else lora_model("llama", cuda)
    module = model.base_model.model.model.layers[0].mlp.up_proj
    assert type(module).__name__ == ("Linear4bit" if quantized else "Linear")
    with torch.no_grad():
        module.lora_B["default"].weight.normal_(0, 0.5)
    torch.manual_seed(4)
    x = torch.randn(2, 64, module.in_features, device=cuda)
    grad = torch.randn(2, 64, module.out_features, device=cuda, dtype=torch.bfloat16)

    def run(forward):
        module.zero_grad(set_to_none=True)
        inputs = x.detach().requires_grad_()
        call = torch.compile(forward, backend="inductor") if compiled else forward
        with torch.autocast("cuda", torch.bfloat16):
            out = call(module, inputs)
        out.backward(grad.to(out.dtype))
        return [out, inputs.grad, module.lora_A["default"].weight.grad, module.lora_B["default"].weight.grad]

    torch._dynamo.reset()
    stock = run(type(module).forward)
    torch._dynamo.reset()
    folded = run(lora4bit_scaled_on_rank if quantized else lambda m, x: lora_two_gemms(m, x, "default"))
    for name, a, b in zip(("output", "input grad", "A grad", "B grad"), stock, folded, strict=True):
        assert torch.equal(a, b), f"{name}: max difference {(a.float() - b.float()).abs().max().item():.3g}"


WARM_POOL_SCRIPT = """
import sys, time
import torch
from torch._inductor.async_compile import AsyncCompile
from transformers import Trainer, TrainingArguments
import leantrain
from leantrain.cli.tiny import tiny_model
from testkit.batches import pad_right, random_rows
from testkit.optimizations import only

model = tiny_model("llama", vocab_size=512, hidden=128, layers=2).cuda().train()
args = TrainingArguments(output_dir=sys.argv[1], report_to=[], save_strategy="no", max_steps=1, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=random_rows(2, (16,), 512), data_collator=pad_right)
before = AsyncCompile.process_pool.cache_info().currsize
leantrain.patch_trainer(trainer, **only("compile_layers"))
after = AsyncCompile.process_pool.cache_info().currsize
start = time.perf_counter()
AsyncCompile.wait_pool_ready() if after else None
print(before, after, f"{time.perf_counter() - start:.2f}")
"""


@pytest.mark.parametrize("warm_pool", ["1", "0"])
def test_patch_starts_inductors_compile_workers_before_the_first_compile(warm_pool, tmp_path):
    """In a fresh process (no compile has run): after ``patch_trainer`` with the compiled layers, inductor's Triton
    compile pool exists (its workers start while the trainer sets up, so the first compile's kernels build in
    parallel); ``TORCH_WARM_POOL=0``, torch's own switch, still keeps it from starting."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_WARM_POOL": warm_pool, "TORCHINDUCTOR_COMPILE_THREADS": "4"}
    done = subprocess.run(
        [sys.executable, "-c", WARM_POOL_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, after, ready_s = done.stdout.split()[-3:]
    assert before == "0", "a compile pool existed before patch_trainer"
    assert after == ("1" if warm_pool == "1" else "0"), f"TORCH_WARM_POOL={warm_pool}: pool count {after}"
    print(f"compile pool ready {ready_s} s after patch_trainer returned")
