"""The LM-head op's inputs, its fp64 reference with the per-token bounds (derived in the docstring of
tests/parity/test_lm_head_ops.py) and the runners, shared by the CPU op tests, their Triton-interpreter script and
the CUDA tests. (A helper module: a test module is never imported as one.)"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from leantrain.lm_head import ops


U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


N, H, V = 123, 48, 1001


def make_inputs(seed=0, n=N, v=V, h=H, dtype=torch.float32, bias=True, top1_share=0.5, logit_std=2.5):
    """7 ignored rows, both vocab edges as targets; about ``top1_share`` of the rows target their argmax (so is_top1
    has both values), the rest a random token."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * (logit_std / math.sqrt(h))).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None
    x = hidden.double() @ weight.double().T + (0 if b is None else b.double())
    targets = torch.where(torch.rand(n, generator=g) < top1_share, x.argmax(1), torch.randint(0, v, (n,), generator=g))
    targets[:7] = -100
    targets[7], targets[8] = 0, v - 1
    return hidden, weight, b, targets


def spiked_inputs(seed=0, n=N, v=V, h=H, dtype=torch.float32):
    """Rows whose largest logit is 60-300 nats above the target's (the op's reference moves up, see ops._OVERFLOW):
    a logit std of 40, and rows 9-20 aligned with the weight row of column v - 5 (the last vocab tile), so that column
    stands out of everything before it (the reference moves after earlier tiles were accumulated); rows 9-11 target it.
    """
    hidden, weight, bias, targets = make_inputs(seed, n, v, h, torch.float32, top1_share=0.2, logit_std=40.0)
    spike = weight[v - 5]
    hidden[9:21] = spike * (300 / spike.square().sum())
    targets[9:12] = v - 5
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), targets


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


def upstream(n, seed=1):
    """Random upstream gradients for logp and entropy, nonzero on ignored rows too (the op must drop them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


# ---------------------------------------------------------------------------------------------- the reference
@dataclass
class Reference:
    logp: torch.Tensor
    entropy: torch.Tensor
    top1: torch.Tensor
    decided: torch.Tensor  # rows whose argmax no rounding can change
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    logp_bound: torch.Tensor
    ent_bound: torch.Tensor
    grad_bounds: dict[str, float]
    grad_fp32_bounds: dict[str, float]  # the fp32 part alone (what any 16-bit path adds on top is its roundings)


def reference(hidden, weight, bias, targets, *, temperature=1.0, scale=1.0, softcap=None, loss="stats", grads="head",
              entropy_grad=True, loss_scale=1.0, dtype=None, rows=None) -> Reference:  # fmt: skip
    """fp64 values, gradients and bounds (module docstring) of the inputs as given (already rounded to their dtype), on
    their device, ``rows`` rows at a time (the loss is a sum over rows). ``loss``: "stats" (Σ g_logp·logp
    (+ Σ g_ent·entropy) with :func:`upstream`), "nll" or "dft" (``head_loss``)."""
    dtype = dtype or hidden.dtype
    n, h_dim = hidden.shape
    v = weight.shape[0]
    k = abs(scale) / temperature
    w = weight.double().requires_grad_(grads == "head")
    b = None if bias is None else bias.double().requires_grad_(grads != "frozen")
    g_logp, g_ent = (t.to(hidden.device).double() for t in upstream(n))
    parts: dict[str, list] = {}
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for r0 in range(0, n, rows or n):
        sl = slice(r0, min(r0 + (rows or n), n))
        h = hidden[sl].double().requires_grad_()
        x = h @ w.T + (0 if b is None else b)
        z = x * scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        logp_all = torch.log_softmax(z, -1)
        t = targets[sl]
        valid = t >= 0
        logp = torch.where(valid, logp_all.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0.0)
        entropy = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
        if loss == "stats":
            part = (logp * g_logp[sl]).sum() + ((entropy * g_ent[sl]).sum() if entropy_grad else 0)
        else:
            weights = logp.detach().exp() if loss == "dft" else torch.ones_like(logp)
            part = -(logp * weights).sum() * loss_scale
        part.backward()
        total += part.detach()
        x, z = x.detach(), z.detach()
        for name, value in zip(("logp", "entropy", "grad_h"), (logp.detach(), entropy.detach(), h.grad)):
            parts.setdefault(name, []).append(value)
        bounds = token_bounds(x, z, t, dtype, k, scale, h_dim)
        for name, value in zip(("logp_bound", "ent_bound", "x_rms", "top1", "decided"), bounds):
            parts.setdefault(name, []).append(value)
        del x, z, logp_all
    cat = {name: torch.cat(values) for name, values in parts.items()}
    x_rms_max = cat["x_rms"].max().item()
    u, u32 = U[dtype], U[torch.float32]
    # gradients: reduction lengths V (dh) and N (dW, db); the scalar loss rounds a ⊙ h (dW) and a (db) as well
    roundings = {"grad_h": 2, "grad_w": 3 if loss != "stats" else 2, "grad_b": 3 if loss != "stats" else 2}
    lengths = {"grad_h": v, "grad_w": n, "grad_b": n}
    fp32 = {name: 8 * u32 * (math.sqrt(h_dim) * k * x_rms_max + math.sqrt(length)) for name, length in lengths.items()}
    tile_u = 0 if dtype == torch.float32 else u
    grad_bounds = {name: fp32[name] + tile_u * (roundings[name] + 2 * k * x_rms_max) for name in lengths}
    found = {
        "grad_h": cat["grad_h"],
        "grad_w": w.grad if grads == "head" else None,
        "grad_b": b.grad if b is not None and grads != "frozen" else None,
    }
    return Reference(cat["logp"], cat["entropy"], cat["top1"], cat["decided"], total, found, cat["logp_bound"],
                     cat["ent_bound"], grad_bounds, fp32)  # fmt: skip


def token_bounds(x, z, targets, dtype, k, scale, h_dim):
    """Per-token bounds on |Δlogp| and |Δentropy| (module docstring), the rows' x_rms, the reference top-1 flags and
    the rows whose argmax no rounding can change; x: the fp64 head output [rows, V], z: the fp64 logits."""
    u, u32 = U[dtype], U[torch.float32]
    tile_u = 0.0 if dtype == torch.float32 else u
    v = z.shape[1]
    p = torch.softmax(z, -1)
    log_z = torch.logsumexp(z, -1)
    mu = (p * z).sum(-1)
    xk = x.abs() * k
    x_rms = x.square().mean(-1).sqrt()
    gemm = 2 * 4 * u32 * math.sqrt(h_dim) * k * x_rms
    tc = targets.clamp(min=0)[:, None]
    dev = (z - mu[:, None]).abs()
    # the tile rounding moves each logit by up to d_j = u·k|x_j| at once: first-order terms taken at the worst point
    # of that box (mean value theorem): p_j grows by at most e^(2·max d), |z_j - μ| by 2·max d + (e^(2·max d) - 1)·D
    # with D = Σ p|z - μ| (1 and 0 for ordinary logits; logits of hundreds of nats in bf16 move by whole nats)
    d_max = (tile_u * xk.amax(1))[:, None]
    grow = torch.exp(2 * d_max)
    spread = dev + 2 * d_max + (grow - 1) * (p * dev).sum(-1, keepdim=True)
    logp_bound = tile_u * (xk.gather(1, tc).squeeze(1) + (grow * p * xk).sum(-1)) + gemm
    logp_bound += 4 * u32 * (log_z.abs() + z.gather(1, tc).squeeze(1).abs() + math.log2(v))
    ent_bound = tile_u * (grow * p * xk * spread).sum(-1) + gemm * (p * dev).sum(-1)
    ent_bound += 4 * u32 * (log_z.abs() + mu.abs() + math.log2(v))
    top2 = x.topk(2, dim=1).values
    gap = top2[:, 0] - top2[:, 1]
    # the two largest can swap where a tile rounding (u·|x| each, 16-bit tiles) or the GEMM's fp32 error moves them
    decided = (gap == 0) | (gap > 4 * tile_u * x.abs().amax(1) + 4 * gemm / k)
    top1 = (targets >= 0) & ((x if scale > 0 else -x).argmax(1) == targets)
    return logp_bound, ent_bound, x_rms, top1, decided


def rel_norm(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_matches(out: dict, ref: Reference, targets, what="", slack=1.0):
    """``out``: logp, entropy, is_top1 (None: skipped), grad_h/grad_w/grad_b (None: no gradient), loss (optional)."""
    valid = targets >= 0
    assert out["logp"].dtype == torch.float32 and (out["logp"][~valid] == 0).all(), what
    err = (out["logp"].double() - ref.logp).abs()
    assert (err <= slack * ref.logp_bound)[valid].all(), (what, "logp", (err / ref.logp_bound)[valid].max().item())
    if out.get("entropy") is not None:
        ent = (out["entropy"].double() - ref.entropy).abs()
        assert (out["entropy"][~valid] == 0).all(), what
        worst = (ent / ref.ent_bound)[valid].max().item()
        assert (ent <= slack * ref.ent_bound)[valid].all(), (what, "entropy", worst)
    if out.get("is_top1") is not None:
        assert out["is_top1"].dtype == torch.bool and not out["is_top1"][~valid].any(), what
        assert torch.equal(out["is_top1"][ref.decided], ref.top1[ref.decided]), (what, "is_top1")
    if out.get("loss") is not None:
        # a weighted sum of per-token errors (weights <= the loss scale)
        bound = (ref.logp_bound[valid].sum() * abs(float(out.get("loss_scale", 1.0)))).item()
        assert abs(out["loss"].item() - ref.loss.item()) <= slack * bound, (what, "loss")
    for name, expected in ref.grads.items():
        got = out.get(name)
        assert (got is None) == (expected is None), (what, name)
        if got is None:
            continue
        assert got.dtype == out["dtypes"][name], (what, name, got.dtype)
        if name == "grad_h":
            assert (got[~valid] == 0).all(), (what, "ignored rows' dh")
        assert rel_norm(got, expected) <= slack * ref.grad_bounds[name], (what, name, rel_norm(got, expected))


# ------------------------------------------------------------------------------------------ running the op
def run_stats(hidden, weight, bias, targets, grads, entropy_grad=True, **options) -> dict:
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(grads == "head")
    b = None if bias is None else bias.clone().requires_grad_(grads != "frozen")
    st = ops.token_stats(h, w, targets, bias=b, need_top1=True, entropy_grad=entropy_grad, **options)
    g_logp, g_ent = (t.to(hidden.device) for t in upstream(hidden.shape[0]))
    ((st.logp * g_logp).sum() + ((st.entropy * g_ent).sum() if entropy_grad else 0)).backward()
    dtypes = {"grad_h": hidden.dtype, "grad_w": weight.dtype, "grad_b": None if bias is None else bias.dtype}
    return dict(logp=st.logp.detach(), entropy=st.entropy.detach(), is_top1=st.is_top1, grad_h=h.grad, grad_w=w.grad,
                grad_b=None if b is None else b.grad, dtypes=dtypes)  # fmt: skip


def run_loss(hidden, weight, bias, targets, grads, loss_type="nll", loss_scale=1.0, need_h=True, **options) -> dict:
    h = hidden.clone().requires_grad_(need_h)
    w = weight.clone().requires_grad_(grads == "head")
    b = None if bias is None else bias.clone().requires_grad_(grads != "frozen")
    out = ops.head_loss(h, w, targets, bias=b, loss_type=loss_type, loss_scale=loss_scale, **options)
    assert out.loss.requires_grad and not out.logp.requires_grad and not out.entropy.requires_grad
    out.loss.backward()
    dtypes = {"grad_h": hidden.dtype, "grad_w": weight.dtype, "grad_b": None if bias is None else bias.dtype}
    return dict(logp=out.logp, entropy=out.entropy, is_top1=out.is_top1, loss=out.loss, loss_scale=loss_scale,
                grad_h=h.grad, grad_w=w.grad, grad_b=None if b is None else b.grad, dtypes=dtypes)  # fmt: skip


# --------------------------------------------------------------------------------- Triton, CPU interpreter
SCENARIOS = {
    # name: (inputs, options, kind, grads)
    "frozen_entropy_grad": ("plain", dict(temperature=0.7), "stats", "frozen"),
    "bias_trainable_softcap": ("plain", dict(temperature=0.7, softcap=5.0), "stats", "bias"),
    "head_recompute": ("plain", dict(temperature=0.9), "stats", "head"),
    "head_keep": ("plain", dict(temperature=0.9, keep_logits_mib=1 << 20), "stats", "head"),
    "spiked_frozen": ("spiked", dict(temperature=0.9), "stats", "frozen"),
    "loss_head_nll": ("plain", dict(softcap=5.0, loss_type="nll", loss_scale=0.05), "loss", "head"),
    "loss_head_dft_spiked": ("spiked", dict(loss_type="dft", loss_scale=0.05), "loss", "head"),
    "loss_frozen_dft": ("plain", dict(loss_type="dft", loss_scale=0.05), "loss", "frozen"),
}


SHAPE = dict(n=37, v=403, h=32)


def equal_rows(n: int = 12, v: int = 403, h: int = 32, seed: int = 5):
    """``n`` copies of one hidden row with ``n`` different targets (the first completion token of each generation of
    one GRPO prompt): the same logits, so the same entropy."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, h, generator=g).repeat(n, 1)
    weight = torch.randn(v, h, generator=g) * 0.5
    return hidden, weight, torch.randperm(v, generator=g)[:n]
