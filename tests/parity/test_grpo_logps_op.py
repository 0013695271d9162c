"""Op-level parity of leantrain's fused log-prob/entropy op against an fp64 reference and TRL's own kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from leantrain.lm_head import ops
from tests._grpo_logps_op import N, make_inputs, reference  # noqa: E402


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def norm_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = [
    # (temperature, logit_scale, softcap)
    (1.0, 1.0, None),
    (0.7, 1.0, None),
    (1.0, 0.25, None),
    (0.9, 1.5, 4.0),
]


@pytest.mark.parametrize("max_cols", [32768, 300])  # one vocab tile per row block, or several (online rescaling)
@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_fp32_matches_fp64(case, entropy_grad, trainable, max_cols, monkeypatch):
    monkeypatch.setattr(ops, "MAX_TILE_COLS", max_cols)
    temperature, scale, softcap = case
    hidden, weight, targets = make_inputs()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(trainable)
    logp, entropy = ops.logp_entropy(
        h, w, targets, temperature=temperature, logit_scale=scale, softcap=softcap, entropy_grad=entropy_grad,
        tile_mib=1, backend="torch",
    )  # fmt: skip
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_(trainable)
    ref_logp, ref_entropy = reference(h64, w64, targets, temperature, scale, softcap)
    assert logp.dtype == entropy.dtype == torch.float32
    assert (logp[:7] == 0).all() and (entropy[:7] == 0).all()
    # fp32 sums over 1001 logits: the bound 1e-5 (measured ≈ 3e-6)
    assert (logp.double() - ref_logp).abs().max() <= 1e-5
    assert (entropy.double() - ref_entropy).abs().max() <= 1e-5
    g = torch.Generator().manual_seed(1)
    g_logp, g_entropy = torch.randn(N, generator=g), torch.randn(N, generator=g)
    # the entropy term enters the loss only where the entropy gradient is asked for (the entropy bonus)
    loss = (logp * g_logp).sum() + ((entropy * g_entropy).sum() if entropy_grad else 0)
    ref_loss = (ref_logp * g_logp.double()).sum() + ((ref_entropy * g_entropy.double()).sum() if entropy_grad else 0)
    loss.backward()
    ref_loss.backward()
    assert rel_err(h.grad, h64.grad) <= 1e-5
    assert (h.grad[:7] == 0).all()
    if trainable:
        assert rel_err(w.grad, w64.grad) <= 1e-5
    else:
        assert w.grad is None


def test_entropy_gradient_without_preparation_recomputes():
    """entropy_grad=False prepares only d logp/dh; an unexpected entropy gradient still comes out right."""
    hidden, weight, targets = make_inputs(seed=3)
    h = hidden.clone().requires_grad_()
    logp, entropy = ops.logp_entropy(h, weight, targets, temperature=0.8, entropy_grad=False, backend="torch")
    (logp.sum() + 0.3 * entropy.sum()).backward()
    h64 = hidden.double().requires_grad_()
    ref_logp, ref_entropy = reference(h64, weight, targets, 0.8)
    (ref_logp.sum() + 0.3 * ref_entropy.sum()).backward()
    assert rel_err(h.grad, h64.grad) <= 1e-5


def test_no_grad_and_no_entropy():
    hidden, weight, targets = make_inputs(seed=4)
    with torch.no_grad():
        logp, entropy = ops.logp_entropy(hidden, weight, targets, need_entropy=False, backend="torch")
    assert entropy is None and not logp.requires_grad
    ref_logp, _ = reference(hidden, weight, targets)
    assert (logp.double() - ref_logp).abs().max() <= 1e-5


def test_autocast_bf16_runs_in_bf16():
    """Under bf16 autocast the tiles are bf16 (like TRL), the statistics and outputs fp32: exactly the result of
    bf16 inputs without autocast."""
    hidden, weight, targets = make_inputs(seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = ops.logp_entropy(hidden, weight, targets, backend="torch")
    logp16, entropy16 = ops.logp_entropy(hidden.bfloat16(), weight.bfloat16(), targets, backend="torch")
    assert logp.dtype == torch.float32
    assert torch.equal(logp, logp16) and torch.equal(entropy, entropy16)


@pytest.mark.parametrize("case", [(1.0, 1.0, None), (0.7, 1.0, None), (1.0, 1.0, 30.0)])
def test_bf16_no_worse_than_trl(case):
    """bf16 inputs: error vs the fp64 value of the same (bf16) inputs is no worse than TRL's ChunkedLogProbFunction
    and than materialized bf16 logits + selective_log_softmax (TRL's pre-1.15 path)."""
    pytest.importorskip("trl.kernels.chunked_logprob", reason="needs trl >= 1.15 (TRL's chunked log-prob kernel)")
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    temperature, scale, softcap = case
    hidden, weight, targets = make_inputs(seed=6, n=256, v=4099, h=64)
    hidden = (hidden * 2).bfloat16()  # logit std ≈ 5 as in trained LMs
    weight = weight.bfloat16()
    valid = targets >= 0
    h_ours = hidden.clone().requires_grad_()
    logp, entropy = ops.logp_entropy(
        h_ours, weight, targets, temperature=temperature, softcap=softcap, backend="torch"
    )
    (logp * valid).sum().backward()
    h_trl = hidden.clone().requires_grad_()
    trl_logp, trl_entropy, *_ = ChunkedLogProbFunction.apply(
        h_trl, weight, None, targets.clamp(min=0), temperature, 32768, softcap, scale, ("log_probs", "entropy")
    )
    (trl_logp * valid).sum().backward()
    z = (hidden @ weight.T).float()  # materialized bf16 product, as the model's lm_head computes it
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.bfloat16()
    mat_logp = selective_log_softmax(z / temperature, targets.clamp(min=0))
    mat_entropy = entropy_from_logits((z / temperature).float())
    h64 = hidden.double().requires_grad_()
    ref_logp, ref_entropy = reference(h64, weight, targets, temperature, scale, softcap)
    ref_logp.sum().backward()

    def err(x, ref):
        return (x.double() - ref)[valid].abs().max().item()

    ours, trl, mat = err(logp, ref_logp), err(trl_logp, ref_logp), err(mat_logp, ref_logp)
    assert ours <= trl * 1.05 + 1e-6, (ours, trl)
    assert ours <= mat, (ours, mat)
    assert err(entropy, ref_entropy) <= max(err(trl_entropy, ref_entropy), err(mat_entropy, ref_entropy)) * 1.05 + 1e-6
    # gradients: both round dL/dz (ours: p·f) to bf16 before the GEMM and the result to bf16; the Frobenius error
    # averages the final rounding (max-abs is decided by one rounding); 5% slack for that noise
    ours_g, trl_g = norm_err(h_ours.grad, h64.grad), norm_err(h_trl.grad, h64.grad)
    print(case, "logp", ours, trl, mat, "grad", ours_g, trl_g)
    assert ours_g <= trl_g * 1.05, (ours_g, trl_g)


def test_plan_tiles_respects_budget():
    rows, cols = ops.plan_tiles(8192, 151936, 512, 2)
    assert (rows, cols) == (4096, 32768)
    rows, cols = ops.plan_tiles(8192, 151936, 16, 2)
    assert rows * cols * 2 <= 16 * 2**20 and rows >= 16
    rows, cols = ops.plan_tiles(100, 1001, 1, 28)
    assert rows * cols * 28 <= 2**20


_TRITON_SCRIPT = textwrap.dedent(
    """
    import math
    import torch
    from leantrain.lm_head import ops
    torch.manual_seed(0)
    ops.MAX_TILE_COLS = 160  # several vocab tiles and a ragged last one
    n, h, v = 37, 32, 403
    hidden, weight = torch.randn(n, h), torch.randn(v, h) * 0.4
    targets = torch.randint(0, v, (n,)); targets[:3] = -100; targets[3] = 0; targets[4] = v - 1
    valid = targets >= 0
    worst = 0.0
    for temperature, softcap, trainable, entropy_grad in [(1.0, None, False, True), (0.7, 5.0, False, True),
                                                         (0.9, None, True, False)]:
        # each backend's fold error: a few fp32 roundings of the magnitudes it adds up (|logZ|, |mu|, |z_y|, log2 V)
        z = hidden.double() @ weight.double().T
        z = (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature
        log_z = torch.logsumexp(z, -1)
        mu = (torch.softmax(z, -1) * z).sum(-1)
        z_y = z.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
        bound = 2 * 4 * 2.0**-24 * (log_z.abs() + mu.abs() + z_y.abs() + math.log2(v))
        grads = []
        outs = []
        for backend in ("torch", "triton"):
            hh = hidden.clone().requires_grad_(); ww = weight.clone().requires_grad_(trainable)
            lp, en = ops.logp_entropy(hh, ww, targets, temperature=temperature, softcap=softcap,
                                      entropy_grad=entropy_grad, tile_mib=1, backend=backend)
            (lp.sum() + 0.5 * en.sum()).backward()
            outs.append((lp, en)); grads.append((hh.grad, ww.grad))
        for a, b in ((outs[0][0], outs[1][0]), (outs[0][1], outs[1][1])):
            worst = max(worst, ((a - b).abs() / bound)[valid].max().item())
        # gradients: the statistics' error enters every p_j = e^(z_j - logZ) as a relative error
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item() / bound[valid].max().item()
        worst = max(worst, rel(grads[1][0], grads[0][0]))
        if trainable:
            worst = max(worst, rel(grads[1][1], grads[0][1]))
    print("WORST", worst)
    """
)


@pytest.mark.slow
def test_triton_kernels_in_interpreter_match_torch():
    """The Triton kernels (CPU interpreter) agree with the torch path: same statistics, same Jacobians, within the
    two folds' fp32 rounding (they sum in other orders, and the Triton fold in column blocks)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = float(proc.stdout.split("WORST")[-1])
    assert worst <= 1, worst  # as a fraction of the per-token bound


# ------------------------------------------------------------------ input checks: declined before any kernel launch
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda h, w, t: (h, w, t[:-1]), "targets must be"),  # a short targets vector would be read past its end
        (lambda h, w, t: (h, w, t.float()), "integer tensor"),
        (lambda h, w, t: (h, w.to(torch.int8), t), "quantized LM head"),
        (lambda h, w, t: (h, w.to("meta"), t), "one device"),
    ],
)
def test_malformed_inputs_raise_before_launch(make, match):
    from leantrain.lm_head._checks import UnsupportedInput

    hidden, weight, targets = make(*make_inputs(n=9, v=31, h=8))
    with pytest.raises(UnsupportedInput, match=match):
        ops.logp_entropy(hidden, weight, targets, backend="torch")


def test_triton_backend_declines_unsupported_inputs(monkeypatch):
    """CPU tensors and fp64 are declined for Triton up front (a launch on them would not be a clean error)."""
    from leantrain.lm_head._checks import UnsupportedInput, input_reasons

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter is the one CPU place Triton may run
    hidden, weight, targets = make_inputs(n=9, v=31, h=8)
    with pytest.raises(UnsupportedInput, match="runs on CUDA tensors"):
        ops.logp_entropy(hidden, weight, targets, backend="triton")
    reasons = input_reasons(hidden.double(), weight.double(), targets, "triton", torch.float64)
    assert any("not torch.float64" in r for r in reasons) and any("CUDA" in r for r in reasons)
    assert input_reasons(hidden, weight, targets, "torch", torch.float32) == []
    assert "unknown backend" in input_reasons(hidden, weight, targets, "cuda", torch.float32)[0]


@pytest.mark.expect_fallback
def test_unsupported_input_falls_back_to_torch(monkeypatch):
    """The trainer's op runner: a declined Triton call warns once and runs the torch backend, same result."""
    from leantrain.fallback import RuntimeFallback
    from leantrain.grpo_logps import patch as glue

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(ops, "default_backend", lambda device: "triton")  # as on CUDA; these tensors are on CPU
    st = glue.HeadSettings(0.7, ("log_probs", "entropy"), False, 1.0, None, "base_model", None)
    hidden, weight, targets = make_inputs(n=9, v=31, h=8)
    guard = RuntimeFallback("grpo_logps triton kernel", strict=False)
    with pytest.warns(RuntimeWarning, match="UnsupportedInput: the Triton backend runs on CUDA"):
        logp, entropy = glue.run_op(guard, 64, 0, st, hidden, weight, targets, True, False)
    ref = ops.logp_entropy(hidden, weight, targets, temperature=0.7, backend="torch")
    assert torch.equal(logp, ref[0]) and torch.equal(entropy, ref[1])
    strict = RuntimeFallback("grpo_logps triton kernel", strict=True)
    with pytest.raises(ValueError, match="runs on CUDA"):
        glue.run_op(strict, 64, 0, st, hidden, weight, targets, True, False)


def test_probe_declines_unusable_head_weights():
    from leantrain.models import head_weight_reasons as weight_reasons

    assert weight_reasons(torch.zeros(4, 3)) == []
    assert "quantized head" in weight_reasons(torch.zeros(4, 3, dtype=torch.uint8))[0]
    assert "meta device" in weight_reasons(torch.zeros(4, 3, device="meta"))[0]
    assert "expected [vocab, hidden]" in weight_reasons(torch.zeros(4, 3, 2))[0]
    assert "no weight tensor" in weight_reasons(None)[0]
