"""The gated LoRA MLP's backward in fp64 from the 16-bit operands both paths use (compile_layers' ``GatedLoraMlp``
against autograd through the three one-GEMM projections), and the rounding bound the two are held to.

Every result of the 16-bit backward is a chain of at most ``ROUNDINGS`` roundings to the compute dtype, each of
relative size ``u`` (the unit roundoff) of a partial sum no larger than the sum of the absolute terms: the down
projection's input gradient (the rank-r gradient, the GEMM, the adapter's term added), the SiLU-gate gradients (the
product ``dh * u`` and the derivative), each projection's input-gradient products and their sum over gate and up,
and the adapter gradients' GEMMs (once over all rows, or once per row chunk and then summed in fp32). So each
elementwise error against the exact result is at most ``ROUNDINGS * u * magnitude``, where ``magnitude`` is the same
computation on the absolute values (fp64), plus the fp32 accumulation of the GEMMs (``inner * 2^-24`` of it each)."""

from __future__ import annotations

import torch

from testkit.lora_gemm import FP32_ROUNDOFF, UNIT_ROUNDOFF


ROUNDINGS = 8


def mlp_backward_fp64(operands: dict[str, torch.Tensor], scales: list[float], absolute: bool = False) -> dict:
    """The input and the six adapter gradients of ``down(silu(gate) * up)`` in fp64, from the 16-bit operands
    (``x``, ``grad``, ``gate``, ``up``, the saved rank-r activations ``scaled_g/u/d``, and ``w_*, a_*, b_*``);
    ``absolute``: every operand and the SiLU's factors by their absolute values (the magnitude of each sum)."""
    o = {k: (v.double().abs() if absolute else v.double()) for k, v in operands.items()}
    s_g, s_u, s_d = (abs(s) for s in scales) if absolute else scales
    gate = operands["gate"].double()
    sig = torch.sigmoid(gate)
    silu, dsilu = gate * sig, sig * (1 + gate * (1 - sig))
    if absolute:
        silu, dsilu = silu.abs(), dsilu.abs()
    h = silu * o["up"]
    grad_scaled_d = (o["grad"] @ o["b_d"]) * s_d
    grad_h = o["grad"] @ o["w_d"] + grad_scaled_d @ o["a_d"]
    grad_g, grad_u = grad_h * o["up"] * dsilu, grad_h * silu
    grad_scaled_g, grad_scaled_u = (grad_g @ o["b_g"]) * s_g, (grad_u @ o["b_u"]) * s_u
    grad_x = grad_g @ o["w_g"] + grad_u @ o["w_u"] + grad_scaled_g @ o["a_g"] + grad_scaled_u @ o["a_u"]
    return {
        "x": grad_x,
        "a_g": grad_scaled_g.t() @ o["x"],
        "b_g": grad_g.t() @ o["scaled_g"],
        "a_u": grad_scaled_u.t() @ o["x"],
        "b_u": grad_u.t() @ o["scaled_u"],
        "a_d": grad_scaled_d.t() @ h,
        "b_d": o["grad"].t() @ o["scaled_d"],
    }


def mlp_bounds(operands: dict[str, torch.Tensor], scales: list[float], dtype: torch.dtype) -> tuple[dict, dict]:
    """The exact gradients and each one's elementwise bound (see the module's docstring)."""
    exact = mlp_backward_fp64(operands, scales)
    magnitude = mlp_backward_fp64(operands, scales, absolute=True)
    inner = operands["gate"].shape[-1] + operands["x"].shape[0]  # the longest contraction: intermediate, then rows
    u = UNIT_ROUNDOFF[dtype]
    bounds = {k: (ROUNDINGS * u + 2 * inner * FP32_ROUNDOFF) * m for k, m in magnitude.items()}
    return exact, bounds


NAMES = ("gate_proj", "up_proj", "down_proj")


def rank_side_lora_mlp(model: torch.nn.Module, rank: int, targets: tuple[str, ...] = NAMES, dropout: float = 0.0):
    """The first layer's MLP of ``model`` with PEFT LoRA (``rank``, alpha ``2 * rank``: scaling 2; PEFT's fp32
    adapters) on ``targets``, B drawn (not zero), each projection on the rank-side forward as compile_layers binds
    it."""
    import types

    import peft

    from leantrain.compile_layers.ops import lora_scaled_on_rank

    torch.manual_seed(1)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=list(targets))
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    mlp = model.base_model.model.model.layers[0].mlp
    for name in targets:
        projection = getattr(mlp, name)
        projection.forward = types.MethodType(lora_scaled_on_rank, projection)
    return mlp


def captured_operands(run) -> dict[str, torch.Tensor]:
    """The 16-bit operands ``lora_mlp_backward`` multiplies in one call of ``run()`` (the gated path's backward):
    the output gradient, the input, gate and up outputs, the saved rank-r activations (flattened to rows) and the
    weights ``w_*``, ``a_*``, ``b_*`` of gate (g), up (u), down (d)."""
    from leantrain.compile_layers import ops

    seen = {}
    real = ops.lora_mlp_backward

    def capture(*args):
        seen["args"] = args
        return real(*args)

    ops.lora_mlp_backward = capture
    try:
        run()
    finally:
        ops.lora_mlp_backward = real
    grad, x, gate, up, scaled_g, scaled_u, scaled_d, weights, *_ = seen["args"]
    rows = {"grad": grad, "x": x, "gate": gate, "up": up, "scaled_g": scaled_g, "scaled_u": scaled_u,
            "scaled_d": scaled_d}  # fmt: skip
    keys = [f"{w}_{p}" for p in "gud" for w in "wab"]
    return {**{k: v.reshape(-1, v.shape[-1]) for k, v in rows.items()}, **dict(zip(keys, weights, strict=True))}
