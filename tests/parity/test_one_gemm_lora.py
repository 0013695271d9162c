"""compile_layers' LoRA projection with its wide side as one GEMM (``OneGemmLora``) against PEFT's two GEMMs, on CPU
in bf16 autocast, eager and traced by ``aot_eager`` (the same aten kernels as eager), for plain LoRA and QLoRA (the
base weight dequantized from nf4).

A wide output (gate/up: out > in) makes the forward one GEMM: the output may differ from PEFT's by the rounding bound
of ``testkit.lora_gemm`` (one rounding where PEFT rounds two products and their sum); the backward runs PEFT's ops, so
the input and adapter gradients are PEFT's bits. A wide input (down, k/v) makes the input gradient one GEMM: then the
output and adapter gradients are PEFT's bits and the input gradient is within the bound. Each bound is also checked
to be smaller than the adapter's contribution, so a dropped or mis-scaled adapter term fails."""

from __future__ import annotations

import pytest
import torch

from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers.ops import lora4bit_scaled_on_rank, lora_scaled_on_rank, lora_two_gemms, one_gemm_side
from testkit.lora_gemm import forward_and_grads, operands, sum_of_products_bound


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def lora_layer(dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """One tiny Llama layer with PEFT LoRA (r=4, alpha 8: scaling 2) on up, down and k; B not zero."""
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", vocab_size=64, hidden=64, layers=1)
    torch.manual_seed(1)
    targets = ["up_proj", "down_proj", "k_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets)
    model = peft.get_peft_model(model.to(dtype), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model.base_model.model.model.layers[0]


def qlora_layer() -> torch.nn.Module:
    """The same layer in bf16 with its linears in bitsandbytes nf4 (double-quantized, bf16 compute), as QLoRA loads
    them: PEFT wraps them in its 4-bit LoRA class."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from testkit.moe4bit_models import load_in_4bit_like

    model = tiny_model("llama", vocab_size=64, hidden=64, layers=1).to(torch.bfloat16)
    load_in_4bit_like(model, compute_dtype=torch.bfloat16, double_quant=True)
    torch.manual_seed(1)
    targets = ["up_proj", "down_proj", "k_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model.base_model.model.model.layers[0]


def projection(layer: torch.nn.Module, name: str) -> torch.nn.Module:
    return {"up": layer.mlp.up_proj, "down": layer.mlp.down_proj, "k": layer.self_attn.k_proj}[name]


def two_gemms(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return lora_two_gemms(module, x, "default")


def assert_within(result: torch.Tensor, reference: torch.Tensor, pairs, what: str) -> None:
    bound, largest = sum_of_products_bound(pairs, torch.bfloat16)
    bound = bound.reshape(result.shape)
    error = (result.double() - reference.double()).abs()
    assert (error <= bound).all(), f"{what}: worst excess {(error - bound).max().item():.3g}"
    adapter = (pairs[1][0].double() @ pairs[1][1].double()).abs().reshape(result.shape)
    assert (adapter > bound).any(), f"{what}: the bound does not resolve the adapter's term"
    assert largest.max() > 0


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize(("name", "side"), [("up", "out"), ("down", "in"), ("k", "in")])
@pytest.mark.parametrize("quantized", [False, True])
def test_one_gemm_is_peft_within_one_rounding(quantized, name, side, traced):
    """Plain LoRA (against the two-GEMM rank-side form, PEFT's bits) and QLoRA (against PEFT's own 4-bit forward:
    the base weight dequantized as bitsandbytes' 4-bit matmul does)."""
    module = projection(qlora_layer() if quantized else lora_layer(), name)
    reference = type(module).forward if quantized else two_gemms
    assert type(module).__name__ == ("Linear4bit" if quantized else "Linear")
    torch.manual_seed(4)
    x = torch.randn(2, 24, module.in_features).to(torch.bfloat16)
    grad = torch.randn(2, 24, module.out_features)
    with torch.autocast("cpu", torch.bfloat16):
        assert one_gemm_side(module, x) == side
    forward = lora4bit_scaled_on_rank if quantized else lora_scaled_on_rank
    if traced:
        forward = torch.compile(forward, backend="aot_eager", fullgraph=True)
    peft_out, peft_dx, peft_da, peft_db = forward_and_grads(module, reference, x, grad, "cpu")
    out, dx, da, db = forward_and_grads(module, forward, x, grad, "cpu")
    assert torch.equal(da, peft_da) and torch.equal(db, peft_db), "the adapter gradients are PEFT's ops"
    ops = operands(module, x, grad)
    if side == "out":
        assert torch.equal(dx, peft_dx), "the input gradient runs PEFT's ops"
        assert_within(out, peft_out, [(ops["x"], ops["w"].t()), (ops["scaled"], ops["b"].t())], "output")
    else:
        assert torch.equal(out, peft_out), "the output runs PEFT's ops"
        assert_within(dx, peft_dx, [(ops["dy"], ops["w"]), (ops["grad_scaled"], ops["a"])], "input gradient")


def test_dropout_keeps_the_adapter_input_apart():
    """With LoRA dropout the adapter sees a dropped-out copy of x: its gradient flows back through the mask (two
    input gradients, not one GEMM), equal to PEFT's under the same mask."""
    module = projection(lora_layer(dropout=0.5), "down")
    module.train()
    x = torch.randn(2, 24, module.in_features).to(torch.bfloat16)
    grad = torch.randn(2, 24, module.out_features)
    torch.manual_seed(7)
    peft_run = forward_and_grads(module, two_gemms, x, grad, "cpu")
    torch.manual_seed(7)
    run = forward_and_grads(module, lora_scaled_on_rank, x, grad, "cpu")
    for what, a, b in zip(("output", "input grad", "A grad", "B grad"), peft_run, run, strict=True):
        assert torch.equal(a, b), what


@pytest.mark.parametrize(
    ("case", "expected"),
    [("fp32", None), ("bf16 with fp32 adapters", None), ("bf16", "out"), ("bias", None), ("square", None)],
)
def test_where_the_one_gemm_applies(case, expected):
    """fp32 compute keeps PEFT's exact two GEMMs; so do 16-bit layers with fp32 adapters outside autocast (PEFT
    computes those adapters in fp32), a bias on the base linear, and square projections (no wide side)."""
    layer = lora_layer(dtype=torch.bfloat16 if case.startswith("bf16") else torch.float32)
    module = layer.mlp.up_proj
    if case == "bf16":
        module.lora_A.to(torch.bfloat16), module.lora_B.to(torch.bfloat16)
    if case == "bias":
        module.base_layer.bias = torch.nn.Parameter(torch.zeros(module.out_features), requires_grad=False)
    if case == "square":
        module.base_layer.out_features = module.base_layer.in_features
    x = torch.randn(3, module.in_features, dtype=module.base_layer.weight.dtype)
    assert one_gemm_side(module, x) == expected
    if expected is None and case in ("fp32", "bf16 with fp32 adapters"):
        assert torch.equal(lora_scaled_on_rank(module, x), two_gemms(module, x))


def test_a_trained_base_weight_keeps_two_gemms():
    module = projection(lora_layer(), "up")
    module.base_layer.weight.requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16):
        assert one_gemm_side(module, torch.randn(3, module.in_features)) is None
