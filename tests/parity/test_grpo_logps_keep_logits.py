"""Issue #13: a trainable head's backward reusing the forward's kept logits (``keep_logits_mib``) instead of
recomputing them. The kept tile is the very GEMM output the recompute would produce and the folds and GEMMs after it
are the same, so on CPU every output and gradient is bitwise equal (``torch.equal``, no tolerance)."""

from __future__ import annotations

import contextlib
import textwrap
import weakref

import pytest
import torch

from leantrain.lm_head import ops
from tests._grpo_logps_op import make_inputs
from tests._interpreter import run_interpreted


KEEP_ALL = 1 << 20  # MiB: keeps the logits of any shape here
# (MAX_TILE_ROWS, MAX_TILE_COLS) over N=123 rows, V=1001 columns at tile_mib=1 (37 fp32 or 40 bf16 rows fit a
# full-width torch tile): 4 x 4 tiles with ragged last ones; 4 row tiles of the whole vocab; 16-row tiles and a
# one-column last tile
TILE_CAPS = [(40, 300), (4096, 32768), (16, 1000)]


@pytest.fixture
def mm_calls(monkeypatch) -> list[int]:
    """Counts ``torch.mm`` calls: the op computes each logits tile with one (the grad GEMMs are addmm)."""
    calls: list[int] = []
    real = torch.mm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", counting)
    return calls


def op(hidden, weight, targets, keep_mib, need_h=True, **kwargs):
    h = hidden.clone().requires_grad_(need_h)
    w = weight.clone().requires_grad_()
    logp, entropy = ops.logp_entropy(h, w, targets, tile_mib=1, backend="torch", keep_logits_mib=keep_mib, **kwargs)
    return h, w, logp, entropy


def loss_of(logp, entropy, entropy_loss=True):
    """Random upstream gradients, nonzero on the ignored rows too (the op must drop them); with ``entropy_loss``
    the entropy carries a gradient as well (TRL's entropy bonus)."""
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(logp.shape[0], generator=g), torch.randn(logp.shape[0], generator=g)
    return (logp * g_logp).sum() + ((entropy * g_ent).sum() if entropy_loss else 0)


def run(hidden, weight, targets, keep_mib, need_h=True, **kwargs):
    h, w, logp, entropy = op(hidden, weight, targets, keep_mib, need_h, **kwargs)
    kept = logp.grad_fn.kept_logits is not None
    loss_of(logp, entropy, kwargs.get("entropy_grad", True)).backward()
    return kept, (logp.detach(), entropy.detach(), h.grad, w.grad)


def assert_bitwise(ours, ref):
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w"), ours, ref):
        assert (a is None) == (b is None), name
        assert a is None or torch.equal(a, b), f"{name}: max |diff| {(a.double() - b.double()).abs().max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [(1.0, 1.0, None), (0.9, 1.5, 4.0)], ids=["plain", "softcap"])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("caps", TILE_CAPS, ids=str)
def test_kept_equals_recompute(caps, entropy_grad, case, dtype, monkeypatch):
    monkeypatch.setattr(ops, "MAX_TILE_ROWS", caps[0])
    monkeypatch.setattr(ops, "MAX_TILE_COLS", caps[1])
    temperature, scale, softcap = case
    hidden, weight, targets = make_inputs(dtype=dtype)  # 7 ignored rows (-100), both vocab edges as targets
    kw = dict(temperature=temperature, logit_scale=scale, softcap=softcap, entropy_grad=entropy_grad)
    kept, ours = run(hidden, weight, targets, KEEP_ALL, **kw)
    recomputed, ref = run(hidden, weight, targets, 0, **kw)
    assert kept and not recomputed
    assert_bitwise(ours, ref)
    assert (ours[2][:7] == 0).all() and ours[3].abs().sum() > 0


def test_kept_without_hidden_grad():
    """Only dW wanted (hidden detached): the kept tiles feed the dW GEMM alone."""
    hidden, weight, targets = make_inputs(seed=2)
    kept, ours = run(hidden, weight, targets, KEEP_ALL, need_h=False, temperature=0.7)
    _, ref = run(hidden, weight, targets, 0, need_h=False, temperature=0.7)
    assert kept and ours[2] is None
    assert_bitwise(ours, ref)


@pytest.mark.parametrize(
    ("dtype", "keep_mib", "keeps"),
    [(torch.float32, 1, False), (torch.float32, 2, True), (torch.bfloat16, 1, True), (torch.float32, 0, False)],
)
def test_budget_decides_and_recompute_runs_the_gemms(dtype, keep_mib, keeps, mm_calls, monkeypatch):
    """[300, 1001] logits (rows padded to 1024): 1.17 MiB in fp32, 0.59 MiB in bf16. Kept: the backward runs no
    logits GEMM; over budget it recomputes every tile (15 x 4 of them)."""
    monkeypatch.setattr(ops, "MAX_TILE_ROWS", 20)
    monkeypatch.setattr(ops, "MAX_TILE_COLS", 300)
    tiles = 15 * 4
    hidden, weight, targets = make_inputs(n=300, dtype=dtype)
    assert ops._keeps_logits(300, 1001, dtype, keep_mib) is keeps
    h, w, logp, entropy = op(hidden, weight, targets, keep_mib)
    assert len(mm_calls) == tiles
    assert (logp.grad_fn.kept_logits is not None) is keeps
    loss_of(logp, entropy).backward()
    assert len(mm_calls) == tiles + (0 if keeps else tiles)


def test_budget_counts_the_compute_dtype():
    """fp32 inputs under bf16 autocast compute bf16 tiles: the bf16 size is what must fit."""
    hidden, weight, targets = make_inputs(n=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, logp, _ = op(hidden, weight, targets, 1)
    assert logp.grad_fn.kept_logits.dtype == torch.bfloat16


def test_retain_graph_second_backward_recomputes(mm_calls, monkeypatch):
    monkeypatch.setattr(ops, "MAX_TILE_ROWS", 40)
    monkeypatch.setattr(ops, "MAX_TILE_COLS", 300)
    tiles = 4 * 4
    hidden, weight, targets = make_inputs(seed=3)
    h, w, logp, entropy = op(hidden, weight, targets, KEEP_ALL, temperature=0.8)
    loss = loss_of(logp, entropy)
    loss.backward(retain_graph=True)
    first = (h.grad.clone(), w.grad.clone())
    assert len(mm_calls) == tiles and logp.grad_fn.kept_logits is None  # consumed, nothing recomputed
    h.grad = w.grad = None
    loss.backward()
    assert len(mm_calls) == 2 * tiles  # the second backward recomputed every tile
    assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])


def test_kept_logits_released_after_backward():
    hidden, weight, targets = make_inputs(seed=4)
    _, _, logp, entropy = op(hidden, weight, targets, KEEP_ALL)
    kept = logp.grad_fn.kept_logits
    assert kept.shape == (hidden.shape[0], weight.shape[0]) and kept.dtype == hidden.dtype
    assert kept.stride(0) == 1024  # V = 1001 padded to aligned rows
    ref = weakref.ref(kept)
    del kept
    loss = loss_of(logp, entropy)
    loss.backward(retain_graph=True)  # the graph (and its ctx) stays alive: only the kept tensor must go
    assert ref() is None and logp.grad_fn.kept_logits is None


def test_nothing_kept_without_a_graph_or_a_trainable_head(monkeypatch):
    """Under no_grad (old-policy / reference log-probs) autograd still reports needs_input_grad: keep nothing there;
    a frozen head has its Jacobian mode and no recompute to save."""
    keeps: list[bool] = []
    real = ops._forward

    def spy(*args):
        keeps.append(args[6] if len(args) > 6 else False)
        return real(*args)

    monkeypatch.setattr(ops, "_forward", spy)
    hidden, weight, targets = make_inputs(seed=5)
    with torch.no_grad():
        op(hidden, weight, targets, KEEP_ALL)
    h = hidden.clone().requires_grad_()
    logp, _ = ops.logp_entropy(h, weight, targets, keep_logits_mib=KEEP_ALL, backend="torch")
    assert logp.grad_fn.kept_logits is None
    op(hidden, weight, targets, KEEP_ALL)
    assert keeps == [False, False, True]


def test_kept_with_weight_context():
    """ZeRO-3's gather still wraps the backward (dh needs the weight even when the logits are kept)."""
    entered: list[int] = []

    @contextlib.contextmanager
    def gather():
        entered.append(1)
        yield

    hidden, weight, targets = make_inputs(seed=6)
    kept, ours = run(hidden, weight, targets, KEEP_ALL, weight_context=gather)
    assert kept and entered == [1]
    _, ref = run(hidden, weight, targets, 0)
    assert_bitwise(ours, ref)


_TRITON_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from leantrain.lm_head import ops
    torch.manual_seed(0)
    ops.MAX_TILE_ROWS, ops.MAX_TILE_COLS = 16, 160  # 3 x 3 tiles, ragged last ones
    n, h, v = 37, 32, 403
    hidden, weight = torch.randn(n, h), torch.randn(v, h) * 0.4
    targets = torch.randint(0, v, (n,)); targets[:3] = -100; targets[3] = 0; targets[4] = v - 1
    g_logp, g_ent = torch.randn(n), torch.randn(n)
    saved = {}
    for softcap in (None, 5.0):
        for keep in (0, 1 << 20):
            hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            lp, en = ops.logp_entropy(hh, ww, targets, temperature=0.7, softcap=softcap, tile_mib=1,
                                      backend="triton", keep_logits_mib=keep)
            kept = lp.grad_fn.kept_logits is not None
            ((lp * g_logp).sum() + (en * g_ent).sum()).backward()
            saved[(softcap, keep)] = (kept, (lp.detach(), en.detach(), hh.grad, ww.grad))
    torch.save(saved, sys.argv[1])
    """
)


@pytest.mark.slow
def test_triton_kept_equals_recompute_in_interpreter(tmp_path):
    """The Triton stats kernel leaves the kept tile as the GEMM wrote it; the grad kernel works on the kept view."""
    pytest.importorskip("triton")
    saved = run_interpreted(_TRITON_SCRIPT, tmp_path / "keep.pt")
    for softcap in (None, 5.0):
        (kept, ours), (recomputed, ref) = saved[(softcap, 1 << 20)], saved[(softcap, 0)]
        assert kept and not recomputed
        assert_bitwise(ours, ref)
