"""compile_layers' gated LoRA MLP on CUDA (``GatedLoraMlp``: the backward a chunk of rows at a time, its elementwise
steps in Triton) against autograd through the three one-GEMM projections, in bf16 autocast, eager and compiled by
inductor: every gradient within the rounding bound of ``testkit.lora_mlp`` of the exact one and at most twice the
stock path's error (in norm); the Triton kernels within one bf16 rounding of the exact values; and the memory it is
for: a compiled LoRA MLP's forward + backward peaks at least one tokens x intermediate buffer lower."""

from __future__ import annotations

import pytest
import torch

from leantrain.cli.tiny import tiny_model
from leantrain.compile_layers import _triton, ops
from leantrain.compile_layers.ops import gated_lora_mlp
from testkit.lora_mlp import NAMES, captured_operands, mlp_bounds, rank_side_lora_mlp


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
BF16 = torch.bfloat16


def lora_mlp(device: torch.device, hidden: int = 64, intermediate: int = 256) -> torch.nn.Module:
    """A tiny Llama's MLP in bf16 (``hidden`` -> ``intermediate``) with LoRA r8 (scaling 2) on its projections."""
    model = tiny_model("llama", vocab_size=64, hidden=hidden, layers=1)
    model.config.intermediate_size = intermediate
    layer = model.model.layers[0]
    layer.mlp = type(layer.mlp)(model.config)
    return rank_side_lora_mlp(model.to(device, BF16), rank=8)


def stock(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(mlp).forward(mlp, x)


def run(mlp, forward, x, grad, compiled: bool) -> dict[str, torch.Tensor]:
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    call = torch.compile(lambda t: forward(mlp, t), backend="inductor") if compiled else (lambda t: forward(mlp, t))
    with torch.autocast("cuda", BF16):
        out = call(x)
    out.backward(grad.to(out.dtype))
    grads = {"out": out, "x": x.grad}
    for short, name in zip("gud", NAMES, strict=True):
        projection = getattr(mlp, name)
        grads[f"a_{short}"] = projection.lora_A["default"].weight.grad
        grads[f"b_{short}"] = projection.lora_B["default"].weight.grad
    return grads


def operands(mlp, x, grad) -> dict[str, torch.Tensor]:
    """The 16-bit operands of the backward, captured from the eager gated path (its forward is the projections')."""
    return captured_operands(lambda: run(mlp, gated_lora_mlp, x, grad, compiled=False))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_chunked_backward_is_as_close_to_exact_as_autograds(compiled, cuda, monkeypatch):
    monkeypatch.setattr(ops, "MLP_MIN_ROWS", 1)  # four chunks of 150 rows
    mlp = lora_mlp(cuda)
    torch.manual_seed(2)
    x = torch.randn(2, 300, 64, device=cuda, dtype=BF16)
    grad = torch.randn(2, 300, 64, device=cuda)
    reference = run(mlp, stock, x, grad, compiled)
    result = run(mlp, gated_lora_mlp, x, grad, compiled)
    if not compiled:
        assert torch.equal(result["out"], reference["out"])  # the projections' very ops
    exact, bounds = mlp_bounds(operands(mlp, x, grad), [2.0, 2.0, 2.0], BF16)
    for key, value in exact.items():
        for name, grads in (("leantrain", result), ("autograd", reference)):
            error = (grads[key].double().reshape(value.shape) - value).abs()
            assert (error <= bounds[key]).all(), f"{name} {key}: {(error / bounds[key]).max():.2f} of the bound"
        ours = (result[key].double().reshape(value.shape) - value).norm()
        theirs = (reference[key].double().reshape(value.shape) - value).norm()
        assert ours <= 2 * theirs + 1e-12 * value.norm(), f"{key}: error {ours:.3g} vs autograd's {theirs:.3g}"


def test_micro_batches_below_min_rows_take_autograds_backward_when_compiled(cuda, monkeypatch):
    """Compiled by inductor with dynamic shapes (as compile_layers runs a second length): a micro-batch below
    ``min_rows`` rows runs the stock projections (no chunk), one at or above it the chunked backward; each side
    compiles once and every gradient stays within the rounding bound of the exact one."""
    monkeypatch.setattr(ops, "MLP_MIN_ROWS", 1)
    chunks = []
    real = ops.silu_mul
    monkeypatch.setattr(ops, "silu_mul", lambda *args: chunks.append(1) or real(*args))
    mlp = lora_mlp(cuda)
    torch.manual_seed(3)
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)

    call = torch.compile(lambda m, t: gated_lora_mlp(m, t, chunks=2, min_rows=400), backend=counting, dynamic=True)
    counts = []  # the graphs compiled after each call
    for rows, expect in ((150, 0), (300, 2), (170, 0), (260, 2)):  # 2 x rows: below, above, below, above 400
        x = torch.randn(2, rows, 64, device=cuda, dtype=BF16)
        grad = torch.randn(2, rows, 64, device=cuda)
        before = len(chunks)
        result = run(mlp, lambda m, t: call(m, t), x, grad, compiled=False)
        assert len(chunks) - before == expect, rows
        exact, bounds = mlp_bounds(operands(mlp, x, grad), [2.0, 2.0, 2.0], BF16)
        for key, value in exact.items():
            error = (result[key].double().reshape(value.shape) - value).abs()
            assert (error <= bounds[key]).all(), f"{rows} rows, {key}: {(error / bounds[key]).max():.2f} of the bound"
        counts.append(len(compiles))
    assert counts[1] > counts[0] and counts[2:] == [counts[1]] * 2, counts  # each side of the row guard once


def test_the_triton_kernels_round_once(cuda):
    """Each result within one bf16 rounding of the exact value, written as the op writes them: ``dg`` and ``h``
    (then ``du``) side by side in one buffer's rows; the columns past them untouched."""
    torch.manual_seed(0)
    rows, cols = 5, _triton.BLOCK + 3
    g = (torch.randn(rows, cols, device=cuda) * 4).to(BF16)
    u, dh = torch.randn(rows, cols, device=cuda).to(BF16), torch.randn(rows, cols, device=cuda).to(BF16)
    g64, u64, dh64 = g.double(), u.double(), dh.double()
    sig = torch.sigmoid(g64)
    pair = torch.full((rows, 2 * cols + 5), 7.0, device=cuda, dtype=BF16)
    dg, h_then_du = pair[:, :cols], pair[:, cols : 2 * cols]
    _triton.silu_mul(g, u, h_then_du)
    h = h_then_du.clone()
    dg.copy_(dh)
    _triton.silu_mul_backward_(dg, g, u, h_then_du)
    pairs = [
        (h, g64 * sig * u64),
        (h_then_du, dh64 * g64 * sig),
        (dg, dh64 * u64 * sig * (1 + g64 * (1 - sig))),
    ]
    for result, exact in pairs:
        bound = (2.0**-8 + 16 * 2.0**-24) * exact.abs() + 2.0**-133
        assert ((result.double() - exact).abs() <= bound).all()
    assert (pair[:, 2 * cols :] == 7).all()


def peak(mlp: torch.nn.Module, forward, x: torch.Tensor) -> int:
    """Peak bytes above the start of one compiled forward + backward."""
    torch._dynamo.reset()
    call = torch.compile(lambda t: forward(mlp, t), backend="inductor")

    def step() -> None:
        with torch.autocast("cuda", BF16):
            out = call(x)
        out.backward(torch.ones_like(out))
        mlp.zero_grad(set_to_none=True)
        x.grad = None

    step()  # compiles
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_the_chunked_backward_holds_fewer_wide_buffers(cuda):
    """8192 tokens through a compiled LoRA MLP (256 -> 2048): autograd's backward holds the saved gate and up
    outputs, the gradient of their product and one of theirs (four tokens x intermediate buffers); the chunked one
    the two saved outputs and two quarter-size chunks. At least one buffer lower (1.5 expected)."""
    mlp = lora_mlp(cuda, hidden=256, intermediate=2048)
    x = torch.randn(1, 8192, 256, device=cuda, dtype=BF16, requires_grad=True)
    wide = 8192 * 2048 * 2
    autograd_peak, chunked_peak = peak(mlp, stock, x), peak(mlp, gated_lora_mlp, x)
    assert chunked_peak <= autograd_peak - wide, (chunked_peak / wide, autograd_peak / wide)
