"""The shared LM-head op (``leantrain.lm_head.ops``): per-token log-probs, entropies and top-1 flags with a head bias,
and the scalar SFT loss (``head_loss``), against a plain-torch reference on the full logits in fp64, on CPU.

Bounds (fp32 inputs, u = 2^-24): the op's tile GEMM rounds each head output x_j = h·w_j + b_j after a sum of H
products (a random walk of H roundings of partial sums of size |x|: c·u·sqrt(H)·x_rms, c = 4 for the tail over N·V
values); logp = z_y - logZ and the entropy inherit k = |logit_scale|/T times that for the target and for the
softmax-weighted mean, plus the fp32 fold (one rounding per term of an online logsumexp over V values, the error
growing with the log2(V) levels of its reduction tree). Gradients are compared relative to their norm: the logits'
error carried into dL/dz, then an fp32 GEMM over its reduction length L (u·sqrt(L)), x2 for the cancellation in
Σ_j (1[j=y] - p_j) w_j and x4 for the tail. bf16 inputs: one rounding of every tile value to bf16 (u = 2^-8) on top
(module docstring of tests/gpu/test_grpo_logps_op_cuda.py, whose per-token bounds these are).
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from leantrain.lm_head import ops
from tests._interpreter import run_interpreted


U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
N, H, V = 123, 48, 1001


def reference(h, w, b, targets, temperature=1.0, scale=1.0, softcap=None):
    """fp64 (differentiable) logp, entropy, the head output x and logits z; ignored targets give logp = entropy = 0."""
    x = h.double() @ w.double().T
    if b is not None:
        x = x + b.double()
    z = x * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp_all = torch.log_softmax(z, -1)
    valid = targets >= 0
    logp = logp_all.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0), x, z


def make_inputs(seed=0, n=N, v=V, h=H, dtype=torch.float32, bias=True, top1_share=0.5):
    """Logit std ~2.5; 7 ignored rows, both vocab edges as targets; about ``top1_share`` of the rows target their
    argmax (so is_top1 has both values), the rest a random token."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.4).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None
    x = hidden.double() @ weight.double().T + (0 if b is None else b.double())
    targets = torch.where(torch.rand(n, generator=g) < top1_share, x.argmax(1), torch.randint(0, v, (n,), generator=g))
    targets[:7] = -100
    targets[7], targets[8] = 0, v - 1
    return hidden, weight, b, targets


def near_ties(x: torch.Tensor, bound: float) -> torch.Tensor:
    """Rows whose top two head outputs differ by a nonzero amount below ``bound``: rounding decides their argmax."""
    top2 = x.topk(2, dim=1).values
    gap = top2[:, 0] - top2[:, 1]
    return (gap > 0) & (gap < bound)


def logit_bounds(x, z, targets, dtype, k):
    """Per-token bounds on |Δlogp| and |Δentropy| (module docstring), fp64."""
    u, u32 = U[dtype], U[torch.float32]
    v = z.shape[1]
    p = torch.softmax(z, -1)
    log_z = torch.logsumexp(z, -1)
    mu = (p * z).sum(-1)
    xk = x.abs() * k
    x_rms = x.square().mean(-1).sqrt()
    gemm = 2 * 4 * u32 * math.sqrt(H) * k * x_rms
    tc = targets.clamp(min=0)[:, None]
    z_y = z.gather(1, tc).squeeze(1)
    tile = (u if dtype != torch.float32 else 0) * (xk.gather(1, tc).squeeze(1) + (p * xk).sum(-1))
    dev = (z - mu[:, None]).abs()
    ent_tile = (u if dtype != torch.float32 else 0) * (p * xk * dev).sum(-1) + gemm * (p * dev).sum(-1)
    logp_bound = tile + gemm + 4 * u32 * (log_z.abs() + z_y.abs() + math.log2(v))
    ent_bound = ent_tile + 4 * u32 * (log_z.abs() + mu.abs() + math.log2(v))
    return logp_bound, ent_bound, x_rms.max().item()


def grad_bound(dtype, k, x_rms_max, reduce_len):
    """Relative (Frobenius) gradient bound: fp32 (module docstring); bf16 adds the two roundings of dL/dz and of the
    result and the tile's rounding of each logit carried through the softmax (2u·(1 + k·x_rms))."""
    fp32 = 8 * U[torch.float32] * (math.sqrt(H) * k * x_rms_max + math.sqrt(reduce_len))
    if dtype == torch.float32:
        return fp32
    return fp32 + 2 * U[dtype] * (1 + k * x_rms_max)


def rel_norm(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = [
    # (temperature, logit_scale, softcap)
    (1.0, 1.0, None),
    (0.7, 1.0, None),
    (1.0, 0.25, None),
    (0.9, 1.5, 4.0),
]
GRADS = ["frozen", "bias", "head"]  # which of weight/bias train: neither (jacobian), the bias alone, both


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_cols", [32768, 300])  # one vocab tile per row block, or several with a ragged last one
@pytest.mark.parametrize("grads", GRADS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_token_stats_with_bias_match_fp64(case, grads, max_cols, dtype, monkeypatch):
    monkeypatch.setattr(ops, "MAX_TILE_COLS", max_cols)
    temperature, scale, softcap = case
    k = abs(scale) / temperature
    hidden, weight, bias, targets = make_inputs(dtype=dtype)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(grads == "head")
    b = bias.clone().requires_grad_(grads != "frozen")
    stats = ops.token_stats(
        h, w, targets, bias=b, temperature=temperature, logit_scale=scale, softcap=softcap, need_top1=True,
        tile_mib=1, backend="torch",
    )  # fmt: skip
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    ref_logp, ref_entropy, x, z = reference(h64, w64, b64, targets, temperature, scale, softcap)
    valid = targets >= 0
    assert stats.logp.dtype == stats.entropy.dtype == torch.float32 and stats.is_top1.dtype == torch.bool
    assert (stats.logp[~valid] == 0).all() and (stats.entropy[~valid] == 0).all() and not stats.is_top1[~valid].any()
    logp_bound, ent_bound, x_rms = logit_bounds(x.detach(), z.detach(), targets, dtype, k)
    err = (stats.logp.double() - ref_logp.detach()).abs()
    assert (err <= logp_bound)[valid].all(), (err / logp_bound)[valid].max().item()
    ent_err = (stats.entropy.double() - ref_entropy.detach()).abs()
    assert (ent_err <= ent_bound)[valid].all(), (ent_err / ent_bound)[valid].max().item()
    # top-1: exact, except where the two largest head outputs are closer than the tile's rounding
    ref_top1 = valid & (x.detach().argmax(1) == targets)
    decided = ~near_ties(x.detach(), 64 * U[dtype] * x.detach().abs().max().item())
    assert torch.equal(stats.is_top1[decided], ref_top1[decided])
    assert ref_top1.any() and (valid & ~ref_top1).any()
    g = torch.Generator().manual_seed(1)
    g_logp = torch.randn(N, generator=g)  # nonzero on ignored rows too: the op drops them
    (stats.logp * g_logp).sum().backward()
    (ref_logp * g_logp.double()).sum().backward()
    assert (h.grad[~valid] == 0).all()
    assert rel_norm(h.grad, h64.grad) <= grad_bound(dtype, k, x_rms, V)
    if grads == "head":
        assert rel_norm(w.grad, w64.grad) <= grad_bound(dtype, k, x_rms, N)
    else:
        assert w.grad is None
    if grads != "frozen":
        assert b.grad.dtype == dtype and rel_norm(b.grad, b64.grad) <= grad_bound(dtype, k, x_rms, N)


def integer_inputs(seed, n, v, h, dtype, sign=1.0):
    """Head inputs in {-1, 0, 1}: every head output is a small integer, exact in any summation order and in bf16, so
    ties are exact ties on every CPU and backend (many rows have several maxima, across vocab tiles too). A third of
    the targets is the first maximum of ``sign·x``, a third the last one, a third random."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-1, 2, (n, h), generator=g).to(dtype)
    weight = torch.randint(-1, 2, (v, h), generator=g).to(dtype)
    x = hidden.double() @ weight.double().T
    maxima = sign * x == (sign * x).amax(1, keepdim=True)
    first = maxima.double().argmax(1)  # first index of the maximum
    last = v - 1 - maxima.flip(1).double().argmax(1)
    pick = torch.randint(0, 3, (n,), generator=g)
    targets = torch.where(pick == 0, first, torch.where(pick == 1, last, torch.randint(0, v, (n,), generator=g)))
    targets[:3] = -100
    return hidden, weight, targets, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [(4096, 32768), (40, 300), (16, 7)], ids=str)
@pytest.mark.parametrize("scale", [1.0, -0.5], ids=["scale1", "negative_scale"])
def test_is_top1_first_index_on_ties(tiles, dtype, scale, monkeypatch):
    """torch's ``logits.argmax(-1) == target``: the first of several maxima wins, also across vocab tiles."""
    monkeypatch.setattr(ops, "MAX_TILE_ROWS", tiles[0])
    monkeypatch.setattr(ops, "MAX_TILE_COLS", tiles[1])
    hidden, weight, targets, x = integer_inputs(0, 97, 701, 5, dtype, math.copysign(1.0, scale))
    stats = ops.token_stats(hidden, weight, targets, logit_scale=scale, softcap=3.0, need_top1=True, backend="torch")
    z = 3.0 * torch.tanh(x * scale / 3.0)  # the reference logits (the first index of their maximum is torch's argmax)
    expected = (targets >= 0) & (z.argmax(1) == targets)
    ties = (z == z.amax(1, keepdim=True)).sum(1) > 1
    assert ties.sum() >= 10 and (expected & ties).any() and (~expected & ties & (targets >= 0)).any()
    assert torch.equal(stats.is_top1, expected)


def test_top1_off_and_no_grad():
    hidden, weight, bias, targets = make_inputs(seed=2)
    with torch.no_grad():
        stats = ops.token_stats(hidden, weight, targets, bias=bias, need_entropy=False, backend="torch")
    assert stats.is_top1 is None and stats.entropy is None and not stats.logp.requires_grad
    ref_logp, *_ = reference(hidden, weight, bias, targets)
    assert (stats.logp.double() - ref_logp).abs().max() <= 1e-5
    assert ops.logp_entropy(hidden, weight, targets, bias=bias, backend="torch")[0].shape == (N,)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
@pytest.mark.parametrize("grads", GRADS)
def test_head_loss_matches_fp64(loss_type, grads):
    """TRL's SFT loss: Σ -logp_i / num_items (nll) or Σ -logp_i·p_i.detach() / num_items (dft)."""
    temperature, scale, softcap = 1.0, 1.5, 4.0
    k = scale / temperature
    hidden, weight, bias, targets = make_inputs(seed=3)
    num_items = torch.tensor(float((targets >= 0).sum() + 5))  # e.g. counted over all micro-batches of a step
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(grads == "head")
    b = bias.clone().requires_grad_(grads != "frozen")
    out = ops.head_loss(
        h, w, targets, bias=b, loss_type=loss_type, loss_scale=1 / num_items, temperature=temperature,
        logit_scale=scale, softcap=softcap, tile_mib=1, backend="torch",
    )  # fmt: skip
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    ref_logp, ref_entropy, x, z = reference(h64, w64, b64, targets, temperature, scale, softcap)
    weights = ref_logp.detach().exp() if loss_type == "dft" else torch.ones_like(ref_logp)
    ref_loss = -(ref_logp * weights).sum() / num_items.double()
    valid = targets >= 0
    assert out.loss.dim() == 0 and out.loss.dtype == torch.float32
    assert not out.logp.requires_grad and not out.entropy.requires_grad and out.is_top1 is not None
    logp_bound, ent_bound, x_rms = logit_bounds(x.detach(), z.detach(), targets, torch.float32, k)
    # the loss: a weighted sum of per-token errors (dft weights p <= 1), relative to num_items
    assert abs(out.loss.item() - ref_loss.item()) <= (logp_bound[valid].sum() * 2 / num_items).item()
    assert ((out.entropy.double() - ref_entropy.detach()).abs() <= ent_bound).all()
    torch.testing.assert_close(out.is_top1, valid & (x.argmax(1) == targets))
    out.loss.backward()
    ref_loss.backward()
    assert rel_norm(h.grad, h64.grad) <= grad_bound(torch.float32, k, x_rms, V)
    if grads == "head":
        assert rel_norm(w.grad, w64.grad) <= grad_bound(torch.float32, k, x_rms, N)
    if grads != "frozen":
        assert rel_norm(b.grad, b64.grad) <= grad_bound(torch.float32, k, x_rms, N)


def test_head_loss_rejects_bad_options():
    hidden, weight, bias, targets = make_inputs(n=9, v=31, h=8)
    with pytest.raises(ValueError, match="loss_type"):
        ops.head_loss(hidden, weight, targets, loss_type="chunked_nll")
    with pytest.raises(TypeError, match="entropy gradient"):
        ops.head_loss(hidden, weight, targets, entropy_grad=True)
    with pytest.raises(ValueError, match="logit_scale"):
        ops.token_stats(hidden, weight, targets, logit_scale=0.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda b: b[:-1], "bias must be"),
        (lambda b: b.to(torch.int32), "bias must be floating point"),
        (lambda b: b.to("meta"), "one device"),
    ],
)
def test_bad_bias_raises_before_launch(bad, match):
    from leantrain.lm_head._checks import UnsupportedInput

    hidden, weight, bias, targets = make_inputs(n=9, v=31, h=8)
    with pytest.raises(UnsupportedInput, match=match):
        ops.token_stats(hidden, weight, targets, bias=bad(bias), backend="torch")


_TRITON_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from leantrain.lm_head import ops
    from tests.parity.test_lm_head_ops import integer_inputs, make_inputs
    ops.MAX_TILE_ROWS, ops.MAX_TILE_COLS = 16, 160  # 3 x 3 tiles, ragged last ones
    hidden, weight, bias, targets = make_inputs(seed=4, n=37, v=403, h=32)
    g_logp, g_ent = torch.randn(37), torch.randn(37)
    saved = {}
    for softcap, grads, entropy_grad in [(None, "frozen", True), (5.0, "frozen", False), (5.0, "bias", False),
                                         (None, "head", False)]:
        for backend in ("torch", "triton"):
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_(grads == "head")
            b = bias.clone().requires_grad_(grads != "frozen")
            st = ops.token_stats(h, w, targets, bias=b, temperature=0.7, softcap=softcap, need_top1=True,
                                 entropy_grad=entropy_grad, tile_mib=1, backend=backend)
            ((st.logp * g_logp).sum() + (st.entropy * g_ent).sum()).backward()
            saved[(softcap, grads, backend)] = (st.logp.detach(), st.entropy.detach(), st.is_top1, h.grad, w.grad,
                                                b.grad)
    ih, iw, it, _ = integer_inputs(1, 41, 403, 5, torch.float32)
    for backend in ("torch", "triton"):
        saved[("ties", backend)] = ops.token_stats(ih, iw, it, need_top1=True, backend=backend).is_top1
    torch.save(saved, sys.argv[1])
    """
)


@pytest.mark.slow
def test_triton_matches_torch_in_interpreter(tmp_path):
    """The Triton kernels (CPU interpreter) against the torch backend: the same tiles, so the top-1 flags are equal
    and the statistics and gradients differ by the folds' fp32 summation order only."""
    pytest.importorskip("triton")
    saved = run_interpreted(_TRITON_SCRIPT, tmp_path / "lm_head.pt")
    assert torch.equal(saved[("ties", "torch")], saved[("ties", "triton")])
    for key in [k for k in saved if k[0] != "ties" and k[-1] == "torch"]:
        ours, ref = saved[(*key[:-1], "triton")], saved[key]
        assert torch.equal(ours[2], ref[2]), key
        for name, a, b in zip(("logp", "entropy", "", "grad_h", "grad_w", "grad_b"), ours, ref):
            if name and b is not None:
                # fp32 folds in blocks of 1024 vs one torch reduction: a few roundings of the largest value
                assert (a - b).abs().max() <= 8 * U[torch.float32] * b.abs().max().clamp(min=1), (key, name)
