"""compile_layers' one-GEMM LoRA projection on CUDA against PEFT's two GEMMs, in bf16 autocast: eager (the same
bounds and exact parts as tests/parity/test_one_gemm_lora.py), compiled by inductor (every result within the rounding
bound of ``testkit.lora_gemm``: inductor may pick another GEMM layout, which moves fp32 accumulation order only),
and the memory it is for: a compiled LoRA or QLoRA MLP's forward and backward peaks at least one tokens x
intermediate buffer lower than with two GEMMs."""

from __future__ import annotations

import types

import pytest
import torch

from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers.ops import lora4bit_scaled_on_rank, lora_scaled_on_rank, lora_two_gemms, one_gemm_side
from testkit.lora_gemm import forward_and_grads, operands, sum_of_products_bound


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]


def lora_mlp(
    device: torch.device, hidden: int = 64, intermediate: int = 256, quantized: bool = False
) -> torch.nn.Module:
    """A tiny Llama's MLP in bf16 with LoRA r8 (scaling 2) on its projections, B not zero; ``quantized``: the
    projections in bitsandbytes nf4 (double-quantized, bf16 compute) as QLoRA loads them."""
    import peft

    model = tiny_model("llama", vocab_size=64, hidden=hidden, layers=1)
    model.config.intermediate_size = intermediate
    layer = model.model.layers[0]
    layer.mlp = type(layer.mlp)(model.config)
    model = model.to(device, torch.bfloat16)
    if quantized:
        pytest.importorskip("bitsandbytes")
        from testkit.moe4bit_models import load_in_4bit_like

        load_in_4bit_like(model, compute_dtype=torch.bfloat16, double_quant=True)
    torch.manual_seed(1)
    targets = ["gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model.base_model.model.model.layers[0].mlp


def two_gemms(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return lora_two_gemms(module, x, "default")


def two_gemms_4bit(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The 4-bit rank-side form with two GEMMs: the base's 4-bit GEMM, the adapter's, their sum."""
    return module.base_layer(x).clone() + module.lora_B["default"](
        module.lora_A["default"](x) * module.scaling["default"]
    )


def check(result, reference, pairs, what) -> None:
    bound, _ = sum_of_products_bound(pairs, torch.bfloat16)
    error = (result.double() - reference.double()).abs().reshape(bound.shape)
    assert (error <= bound).all(), f"{what}: worst excess {(error - bound).max().item():.3g}"


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(("name", "side"), [("up_proj", "out"), ("down_proj", "in")])
@pytest.mark.parametrize("quantized", [False, True])
def test_one_gemm_is_peft_within_one_rounding(quantized, name, side, compiled, cuda):
    """Against the two-GEMM rank-side form (plain LoRA: PEFT's bits) or PEFT's own 4-bit forward (QLoRA: bitsandbytes'
    4-bit GEMM, whose kernel choice may differ from dequantize + GEMM, so only the bounds hold there)."""
    module = getattr(lora_mlp(cuda, quantized=quantized), name)
    module.lora_A.float(), module.lora_B.float()  # PEFT's fp32 adapters
    torch.manual_seed(4)
    x = torch.randn(2, 64, module.in_features, device=cuda, dtype=torch.bfloat16)
    grad = torch.randn(2, 64, module.out_features, device=cuda)
    with torch.autocast("cuda", torch.bfloat16):
        assert one_gemm_side(module, x) == side
    forward = lora4bit_scaled_on_rank if quantized else lora_scaled_on_rank
    forward = torch.compile(forward, backend="inductor") if compiled else forward
    reference = forward_and_grads(module, type(module).forward if quantized else two_gemms, x, grad, "cuda")
    out, dx, da, db = forward_and_grads(module, forward, x, grad, "cuda")
    ops = operands(module, x, grad)
    forward_pairs = [(ops["x"], ops["w"].t()), (ops["scaled"], ops["b"].t())]
    input_grad_pairs = [(ops["dy"], ops["w"]), (ops["grad_scaled"], ops["a"])]
    if not compiled and not quantized:
        assert torch.equal(da, reference[2]) and torch.equal(db, reference[3])
        assert torch.equal(dx if side == "out" else out, reference[1] if side == "out" else reference[0])
    check(out, reference[0], forward_pairs, "output")
    check(dx, reference[1], input_grad_pairs, "input gradient")
    check(da.t(), reference[2].t(), [(ops["x"].t(), ops["grad_scaled"])], "A gradient")
    check(db, reference[3], [(ops["dy"].t(), ops["scaled"])], "B gradient")


def peaks(mlp: torch.nn.Module, forward, x: torch.Tensor) -> tuple[int, int]:
    """Peak bytes above the start of one compiled forward, and of that forward + its backward."""
    for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        proj.forward = types.MethodType(forward, proj)
    torch._dynamo.reset()
    call = torch.compile(mlp.forward, backend="inductor")

    def step() -> torch.Tensor:
        with torch.autocast("cuda", torch.bfloat16):
            return call(x)

    step().sum().backward()  # compiles
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - base
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    total_peak = torch.cuda.max_memory_allocated() - base
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    return forward_peak, total_peak


@pytest.mark.parametrize("quantized", [False, True])
def test_one_gemm_holds_fewer_wide_buffers(quantized, cuda):
    """8192 tokens through a compiled LoRA MLP (256 -> 2048): PEFT's two GEMMs hold the gate and up adapter products
    beside the base ones in the forward, and down's adapter input gradient beside the base one in the backward; one
    GEMM holds neither. Forward peak at least 1.5 tokens x intermediate buffers lower (two expected), forward +
    backward at least 0.75 lower (one expected: the backward sets it)."""
    mlp = lora_mlp(cuda, hidden=256, intermediate=2048, quantized=quantized)
    x = torch.randn(1, 8192, 256, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    wide = 8192 * 2048 * 2
    two_forward, two_total = peaks(mlp, two_gemms_4bit if quantized else two_gemms, x)
    one_forward, one_total = peaks(mlp, lora4bit_scaled_on_rank if quantized else lora_scaled_on_rank, x)
    assert one_forward <= two_forward - 1.5 * wide, (one_forward / wide, two_forward / wide)
    assert one_total <= two_total - 0.75 * wide, (one_total / wide, two_total / wide)
