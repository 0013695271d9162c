"""Liger-Kernel's RoPE kernel on CPU through Triton's interpreter: the op against transformers'
``apply_rotary_pos_emb`` (fp32, forward and backward), and each served family's attention with the re-scoped forward
that ``layer_kernels`` binds (only that instance sees the kernel) against the stock attention. fp32 only: the
interpreter (Triton 3.9) returns garbage for this kernel's bf16 loads (cos = 1, sin = 0 does not give q back), so
the bf16 numerics are held to the stock path on CUDA (tests/gpu/test_layer_kernels_cuda.py).

One subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported) runs every kernel call and saves inputs
and outputs; the tests compare them here, in float64.

Bounds (u = fp32's unit roundoff, eps / 2): the rotation is ``a + b`` with ``a = q·cos`` and
``b = rotate_half(q)·sin`` (in the backward ``g·cos`` and ``-rotate_half(g·sin)``); two rounded products and a
rounded sum put an implementation within ``2u(1 + u)(|a| + |b|)`` of the exact value, per element. The attention
output passes the rotated q and k through the scores, softmax and two products: the patched module must stay within
twice the stock fp32 module's own distance from the fp64 module, plus that per-element RoPE bound carried through
(taken as ``4u·|ref|`` in Frobenius norm)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from leantrain.layer_kernels import FAMILIES
from tests._interpreter import assert_within, run_interpreted


pytest.importorskip("triton")
pytest.importorskip("liger_kernel")
pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import copy, dataclasses, sys
    import torch
    from leantrain.fallback import RuntimeFallback
    from leantrain.layer_kernels import FAMILIES, ops
    from leantrain.layer_kernels.patch import install
    from leantrain.layer_kernels.probe import plan_targets
    from leantrain.cli.tiny import tiny_model
    from leantrain.undo import Undo
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    saved = {}
    torch.manual_seed(0)
    # (1) the op: q [2, 4 heads, 6, 16], k [2, 2 heads, 6, 16], per-row positions (cos/sin [2, 6, 16]) as transformers
    # builds them (cat(freqs, freqs)), an upstream gradient for each output
    for dtype in (torch.float32,):
        q, k = torch.randn(2, 4, 6, 16, dtype=dtype), torch.randn(2, 2, 6, 16, dtype=dtype)
        pos = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 3, 9, 0, 2, 11]], dtype=torch.float32)
        inv = 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)
        freqs = pos[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        results = {}
        for name, fn in (("stock", apply_rotary_pos_emb), ("liger", ops.rope)):
            qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
            oq, ok = fn(qi * 1, ki * 1, cos, sin)  # fresh tensors: Liger rotates its inputs in their storage
            torch.autograd.backward((oq, ok), (gq, gk))
            results[name] = dict(q=oq.detach(), k=ok.detach(), dq=qi.grad, dk=ki.grad)
        saved[str(dtype)] = dict(inputs=dict(q=q, k=k, cos=cos, sin=sin, gq=gq, gk=gk), **results)
    # (2) each family's attention: the re-scoped forward (strict guard: a kernel error raises) vs the stock module
    liger_rope, calls = ops.rope, []
    ops.rope = lambda *args: calls.append(1) or liger_rope(*args)  # counted: the stock path must not be what ran
    for family, spec in FAMILIES.items():
        calls.clear()
        model = tiny_model(family, vocab_size=64, hidden=64, layers=1).train()
        readiness = plan_targets(model, family, spec, "test")
        plan = dataclasses.replace(readiness.plan, norms=(), mlps=())
        attn = model.model.layers[0].self_attn
        stock, exact = copy.deepcopy(attn), copy.deepcopy(attn).double()
        install(plan, Undo(), RuntimeFallback("layer_kernels", strict=True))
        hidden = torch.randn(2, 6, 64)
        positions = torch.arange(6)[None].expand(2, 6)
        cos, sin = model.model.rotary_emb(hidden, positions)
        grad = torch.randn(2, 6, 64)
        out = {}
        for name, module, dt in (("liger", attn, torch.float32), ("stock", stock, torch.float32),
                                 ("exact", exact, torch.float64)):
            h = hidden.to(dt).clone().requires_grad_()
            o = module(h, position_embeddings=(cos.to(dt), sin.to(dt)), attention_mask=None)[0]
            o.backward(grad.to(dt))
            out[name] = dict(out=o.detach().double(), dh=h.grad.double(), dwq=module.q_proj.weight.grad.double())
        saved[family] = dict(out, calls=len(calls))
    torch.save(saved, sys.argv[1])
    """
)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return run_interpreted(_SCRIPT, tmp_path_factory.mktemp("rope") / "rope.pt")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_liger_rope_op_matches_the_exact_rotation(interpreted):
    dtype = "torch.float32"
    r = interpreted[dtype]
    x = {n: t.double() for n, t in r["inputs"].items()}
    u = torch.finfo(torch.float32).eps / 2
    cos, sin = x["cos"][:, None], x["sin"][:, None]
    for t in ("q", "k"):
        a, b = x[t] * cos, _rotate_half(x[t]) * sin
        g = x[f"g{t}"]
        ga, gb = g * cos, -_rotate_half(g * sin)  # the backward: rotate_half's transpose is -rotate_half
        for name in ("stock", "liger"):
            bound = 2 * u * (1 + u) * (a.abs() + b.abs()) + 1e-30
            assert_within(r[name][t].double(), a + b, bound, f"{name} {t} {dtype}")
            bound = 2 * u * (1 + u) * (ga.abs() + gb.abs()) + 1e-30
            assert_within(r[name][f"d{t}"].double(), ga + gb, bound, f"{name} d{t} {dtype}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rescoped_attention_matches_stock(interpreted, family):
    r = interpreted[family]
    assert r["calls"] == 1  # the patched module's forward ran Liger's kernel (its stock twin ran the stock RoPE)
    u = torch.finfo(torch.float32).eps / 2
    for key in ("out", "dh", "dwq"):
        exact = r["exact"][key]
        stock_err = float((r["stock"][key] - exact).norm())
        err = float((r["liger"][key] - exact).norm())
        bound = 2 * stock_err + 4 * u * float(exact.norm())
        assert err <= bound, f"{family} {key}: |liger - exact| {err:.3g} > {bound:.3g} (stock's own {stock_err:.3g})"
