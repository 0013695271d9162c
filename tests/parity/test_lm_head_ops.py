"""The shared LM-head op (``leantrain.lm_head.ops``): per-token log-probs, entropies and top-1 flags with a head bias,
and the scalar SFT loss (``head_loss``), against a plain-torch reference on the full logits in fp64, on CPU (the
torch backend here, the Triton kernels under Triton's CPU interpreter in the slow test).

Bounds (u: unit roundoff of the tile dtype, u32 = 2^-24): the op's tile GEMM rounds each head output x_j = h·w_j + b_j
after a sum of H products (a random walk of H roundings of partial sums of size |x|: c·u32·sqrt(H)·x_rms, c = 4 for
the tail over N·V values), then once to the tile dtype (u·|x_j|); logp = z_y - logZ and the entropy inherit
k = |logit_scale|/T times that for the target and the softmax-weighted mean, plus the fp32 fold (one rounding per term
of an online logsumexp over V values, the error growing with the log2(V) levels of its reduction tree). Gradients are
compared relative to their norm: the logits' error carried into dL/dz, then an fp32 GEMM over its reduction length L
(u32·sqrt(L)), x2 for the cancellation in Σ_j (1[j=y] - p_j) w_j and x4 for the tail; a 16-bit dtype adds one
rounding of each GEMM operand it writes (dL/dz or e^(z-m)·f; the scalar loss's a ⊙ h too) and of the result, and the
tile's rounding of each logit carried through the softmax (2u·k·x_rms). These are the per-token bounds of
tests/gpu/test_grpo_logps_op_cuda.py.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from leantrain.lm_head import ops
from tests._interpreter import run_interpreted
from tests._lm_head_refs import (  # noqa: E402
    SCENARIOS,
    SHAPE,
    N,
    U,
    V,
    assert_matches,
    equal_rows,
    integer_inputs,
    make_inputs,
    reference,
    rel_norm,
    run_loss,
    run_stats,
    spiked_inputs,
)


CASES = [
    # (temperature, logit_scale, softcap)
    (1.0, 1.0, None),
    (0.7, 1.0, None),
    (1.0, 0.25, None),
    (0.9, 1.5, 4.0),
]
GRADS = ["frozen", "bias", "head"]  # which of weight/bias train: neither (the prepared d logp/dh), the bias, both


# ------------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_cols", [32768, 300])  # one vocab tile per row block, or several with a ragged last one
@pytest.mark.parametrize("grads", GRADS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_token_stats_with_bias_match_fp64(case, grads, max_cols, dtype, monkeypatch):
    monkeypatch.setattr(ops, "MAX_TILE_COLS", max_cols)
    temperature, scale, softcap = case
    hidden, weight, bias, targets = make_inputs(dtype=dtype)
    options = dict(temperature=temperature, logit_scale=scale, softcap=softcap)
    out = run_stats(hidden, weight, bias, targets, grads, tile_mib=1, backend="torch", **options)
    ref = reference(hidden, weight, bias, targets, grads=grads, scale=scale, temperature=temperature, softcap=softcap)
    assert ref.top1.any() and ((targets >= 0) & ~ref.top1).any()
    assert_matches(out, ref, targets)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["frozen", "head", "loss_head"])
def test_reference_moves_past_far_logits(dtype, path, monkeypatch):
    """Rows whose largest logit is far above the target's (logits up to ~300 nats apart): the reference moves up there,
    within a tile and after earlier tiles were accumulated, and every result stays within the same bounds. fp16
    (e^11 at most) moves it for most rows."""
    monkeypatch.setattr(ops, "MAX_TILE_COLS", 300)
    hidden, weight, bias, targets = spiked_inputs(dtype=dtype)
    x = hidden.double() @ weight.double().T + bias.double()
    gap = x.amax(1) - x.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    assert ((gap > 100) & (targets >= 0)).sum() >= 20 and ((gap > 100)[9:21] | (targets[9:21] == V - 5)).all()
    options = dict(temperature=0.9, tile_mib=1, backend="torch")
    if path == "loss_head":
        out = run_loss(hidden, weight, bias, targets, "head", loss_scale=0.01, **options)
        ref = reference(hidden, weight, bias, targets, temperature=0.9, loss="nll", loss_scale=0.01)
    else:
        out = run_stats(hidden, weight, bias, targets, path, **options)
        ref = reference(hidden, weight, bias, targets, temperature=0.9, grads=path)
    assert_matches(out, ref, targets, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile_mib", [1, 64], ids=["4_chunks", "1_chunk"])  # 36 rows a chunk (ragged last), or all
@pytest.mark.parametrize("grads", ["frozen", "bias", "head", "head_only"])
@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_head_loss_matches_fp64(loss_type, grads, tile_mib, dtype):
    """TRL's SFT loss: Σ -logp_i / num_items (nll) or Σ -logp_i·p_i.detach() / num_items (dft); a trainable head takes
    the scalar path (gradients in the forward, row chunks of the whole vocabulary); head_only: hidden needs no grad."""
    hidden, weight, bias, targets = make_inputs(seed=3, dtype=dtype)
    num_items = torch.tensor(float((targets >= 0).sum() + 5))  # e.g. counted over every micro-batch of the step
    options = dict(temperature=1.0, logit_scale=1.5, softcap=4.0, tile_mib=tile_mib, backend="torch")
    need_h = grads != "head_only"
    grads = "head" if grads == "head_only" else grads
    out = run_loss(hidden, weight, bias, targets, grads, loss_type, 1 / num_items, need_h, **options)
    ref = reference(hidden, weight, bias, targets, scale=1.5, softcap=4.0, loss=loss_type, grads=grads,
                    loss_scale=1 / num_items.double())  # fmt: skip
    if not need_h:
        assert out["grad_h"] is None
        out["grad_h"] = ref.grads["grad_h"].to(dtype)  # not computed: nothing to compare
    assert_matches(out, ref, targets, f"{loss_type}-{grads}")


def test_head_loss_trainable_equals_frozen_path():
    """The scalar path's dh is the frozen path's (the same math through other GEMMs): within fp32 rounding."""
    hidden, weight, bias, targets = make_inputs(seed=5, bias=False)
    opts = dict(loss_type="dft", loss_scale=0.02, temperature=0.7, backend="torch")
    scalar = run_loss(hidden, weight, None, targets, "head", **opts)
    frozen = run_loss(hidden, weight, None, targets, "frozen", **opts)
    assert torch.equal(scalar["is_top1"], frozen["is_top1"])
    assert (scalar["logp"] - frozen["logp"]).abs().max() <= 1e-5
    assert rel_norm(scalar["grad_h"], frozen["grad_h"]) <= 2e-6  # two fp32 routes: tens of u32 relative


def test_head_loss_scales_by_incoming_gradient_and_retained_graph():
    """The gradients computed in the forward are scaled by the loss's gradient, on every backward of a retained
    graph (here 3·loss, backward twice: 6x one plain backward)."""
    hidden, weight, bias, targets = make_inputs(seed=6)
    once = run_loss(hidden, weight, bias, targets, "head", backend="torch")
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    out = ops.head_loss(h, w, targets, bias=b, backend="torch")
    (3 * out.loss).backward(retain_graph=True)
    (3 * out.loss).backward()
    for got, ref in ((h.grad, once["grad_h"]), (w.grad, once["grad_w"]), (b.grad, once["grad_b"])):
        torch.testing.assert_close(got, 6 * ref, rtol=4 * U[torch.float32], atol=0)


def test_no_grad_builds_nothing(monkeypatch):
    """Under no_grad autograd still reports needs_input_grad for inputs that require grad: the op must not prepare
    d logp/dh, keep logits or take the scalar-loss path there."""
    hidden, weight, bias, targets = make_inputs(seed=2)
    modes: list = []
    real_forward, real_loss = ops._forward, ops._loss_forward
    monkeypatch.setattr(ops, "_forward", lambda *a: modes.append(("stats", a[5], a[6])) or real_forward(*a))
    monkeypatch.setattr(ops, "_loss_forward", lambda *a: modes.append(("loss",)) or real_loss(*a))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.no_grad():
        stats = ops.token_stats(h, w, targets, bias=bias, keep_logits_mib=1 << 20, backend="torch")
        loss = ops.head_loss(h, w, targets, bias=bias, backend="torch")
    assert modes == [("stats", False, False), ("stats", False, False)]
    assert not stats.logp.requires_grad and not loss.loss.requires_grad
    ref = reference(hidden, weight, bias, targets, loss="nll")
    assert ((stats.logp.double() - ref.logp).abs() <= ref.logp_bound).all()
    assert stats.is_top1 is None and loss.is_top1 is not None
    assert ops.logp_entropy(hidden, weight, targets, bias=bias, backend="torch")[0].shape == (N,)


def test_head_loss_rejects_bad_options():
    hidden, weight, bias, targets = make_inputs(n=9, v=31, h=8)
    with pytest.raises(ValueError, match="loss_type"):
        ops.head_loss(hidden, weight, targets, loss_type="chunked_nll")
    with pytest.raises(TypeError, match="entropy_grad"):  # the loss has no entropy term
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


def test_triton_declines_vocabularies_beyond_its_grid():
    from leantrain.lm_head._checks import MAX_FOLD_BLOCKS, input_reasons

    hidden, weight = torch.zeros(2, 4), torch.zeros(2, 4)
    targets = torch.zeros(2, dtype=torch.long)
    big = torch.empty_strided((MAX_FOLD_BLOCKS * 64 + 1, 4), (0, 1))  # no memory behind it
    assert not any("column blocks" in r for r in input_reasons(hidden, weight, targets, "triton", torch.float32))
    reasons = input_reasons(hidden, big, targets, "triton", torch.float32, fold_block=64)
    assert any("column blocks" in r for r in reasons)


def test_plan_rows_fits_the_budget():
    assert ops.plan_rows(8192, 256000, 1024, 2) == 2048
    assert ops.plan_rows(8192, 151936, 1024, 2) == 3520 // 64 * 64
    assert ops.plan_rows(100, 1001, 1024, 2) == 100
    assert ops.plan_rows(8192, 256000, 1, 2) == 16  # never fewer than 16 rows


@pytest.mark.parametrize("max_cols", [32768, 160])
@pytest.mark.parametrize("mode", ["no_grad", "frozen", "frozen_entropy_grad", "trainable"])
def test_entropy_does_not_depend_on_the_target(mode, max_cols, monkeypatch):
    """Bitwise: TRL thresholds entropies (GRPO's top_entropy_quantile keeps entropy >= a quantile), so rows with the
    same logits must tie as they do under the stock head, whatever their targets (a reference at the target logit
    gave each target its own last bits, and GRPO trained on other tokens)."""
    monkeypatch.setattr(ops, "MAX_TILE_COLS", max_cols)
    hidden, weight, targets = equal_rows()
    hidden.requires_grad_(mode != "no_grad")
    weight.requires_grad_(mode == "trainable")
    with torch.set_grad_enabled(mode != "no_grad"):
        entropy = ops.token_stats(
            hidden, weight, targets, temperature=0.9, entropy_grad=mode == "frozen_entropy_grad", backend="torch"
        ).entropy
    assert len(set(entropy.tolist())) == 1, entropy.tolist()
    z = (hidden[0].double() @ weight.double().T) / 0.9
    expected = torch.distributions.Categorical(logits=z).entropy().item()
    assert abs(entropy[0].item() - expected) <= 1e-5 * expected  # fp32 sums over 403 columns


_TRITON_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from leantrain.lm_head import ops
    from tests import _lm_head_refs as t
    # 3 x 3 tiles with ragged last ones; fold blocks of 64 columns: several per tile, the last one ragged
    ops.MAX_TILE_ROWS, ops.MAX_TILE_COLS, ops.FOLD_BLOCK = 16, 160, 64
    saved = {}
    for name, (inputs, options, kind, grads) in t.SCENARIOS.items():
        data = (t.make_inputs if inputs == "plain" else t.spiked_inputs)(seed=4, **t.SHAPE)
        run = t.run_stats if kind == "stats" else t.run_loss
        for backend in ("torch", "triton"):
            saved[(name, backend)] = run(*data, grads, tile_mib=1, backend=backend, **options)
    ih, iw, it, _ = t.integer_inputs(1, 41, 403, 5, torch.float32)
    for backend in ("torch", "triton"):
        saved[("ties", backend)] = ops.token_stats(ih, iw, it, need_top1=True, backend=backend).is_top1
        saved[("entropy_ties", backend)] = ops.token_stats(*t.equal_rows(), temperature=0.9, backend=backend).entropy
    torch.save(saved, sys.argv[1])
    """
)


@pytest.mark.slow
def test_triton_matches_fp64_in_interpreter(tmp_path):
    """The Triton kernels (CPU interpreter) within the same bounds of fp64 as the torch backend (several fold blocks
    per tile, ragged tiles, references that move, the scalar loss), and the same top-1 flags bitwise (same tiles)."""
    pytest.importorskip("triton")
    saved = run_interpreted(_TRITON_SCRIPT, tmp_path / "lm_head.pt")
    assert torch.equal(saved[("ties", "torch")], saved[("ties", "triton")])
    for name, (inputs, options, kind, grads) in SCENARIOS.items():
        hidden, weight, bias, targets = (make_inputs if inputs == "plain" else spiked_inputs)(seed=4, **SHAPE)
        ref_opts = {k: options[k] for k in ("temperature", "softcap") if k in options}
        if kind == "loss":
            ref_opts.update(loss=options["loss_type"], loss_scale=options["loss_scale"])
        ref = reference(hidden, weight, bias, targets, grads=grads, **ref_opts)
        for backend in ("torch", "triton"):
            assert_matches(saved[(name, backend)], ref, targets, f"{name} {backend}")
        assert torch.equal(saved[(name, "torch")]["is_top1"], saved[(name, "triton")]["is_top1"]), name
    for backend in ("torch", "triton"):  # rows with the same logits tie whatever their targets
        assert len(set(saved[("entropy_ties", backend)].tolist())) == 1, backend
