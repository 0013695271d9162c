"""leantrain's LM-head op on CUDA (Triton folds, cuBLAS tiles) against the stock CUDA path on the same inputs: the
head's logits materialized by ``F.linear`` in the inputs' dtype and upcast to fp32 (transformers' causal-LM loss),
``log_softmax``, ``argmax``, autograd. Both are held to the fp64 values of the same (rounded) inputs: within the
per-token bounds of tests/_lm_head_refs.py (derived in tests/parity/test_lm_head_ops.py from the dtype's unit
roundoff, H, V and the logits), and no worse than the stock path beyond its own rounding noise. Shapes include V
and N that are no multiple of any tile (4096 rows, 32768 columns, 4096-column fold blocks), a softcap, a logit
scale, a bias, fp32/bf16/fp16, frozen and trainable heads, the scalar SFT loss (nll, dft) in several row chunks, and
rows whose largest logit is hundreds of nats above the target's (the fold's reference moves there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from leantrain.lm_head import ops
from tests._lm_head_refs import assert_matches, reference, rel_norm, run_loss, run_stats, spiked_inputs
from tests.gpu._device import dev_fixture, needs_device  # noqa: F401 (the "dev" fixture)


pytestmark = needs_device


@dataclass(frozen=True)
class Case:
    n: int
    v: int
    h: int
    dtype: torch.dtype
    kind: str = "stats"  # "stats" (token_stats, upstream gradients on logp and entropy), "nll" or "dft" (head_loss)
    grads: str = "frozen"  # frozen: into hidden only; bias: + the bias; head: + weight (and bias if any)
    temperature: float = 1.0
    softcap: float | None = None
    scale: float = 1.0
    bias: bool = False
    inputs: str = "plain"  # "spiked": rows with a logit hundreds of nats above the target's
    tile_mib: int | None = None  # the op's default when None
    entropy_grad: bool = True  # "stats": a gradient on the entropy too (GRPO's entropy bonus)

    def __str__(self) -> str:
        extra = "".join(
            f"-{s}"
            for s, on in (
                (f"T{self.temperature}", self.temperature != 1.0),
                (f"cap{self.softcap}", self.softcap),
                (f"s{self.scale}", self.scale != 1.0),
                ("bias", self.bias),
                (self.inputs, self.inputs != "plain"),
                (f"t{self.tile_mib}", self.tile_mib),
                ("no_entropy_grad", self.kind == "stats" and not self.entropy_grad),
            )
            if on
        )
        return f"{self.n}x{self.v}x{self.h}-{str(self.dtype)[6:]}-{self.kind}-{self.grads}{extra}"


CASES = [
    Case(1000, 32001, 896, torch.bfloat16, temperature=0.7),
    Case(4097, 151936, 2048, torch.bfloat16, "nll"),
    Case(4097, 151936, 1536, torch.bfloat16, "nll", "head"),  # 3520-row chunks: two, the second ragged
    Case(2000, 256000, 2304, torch.bfloat16, "dft", "head", softcap=30.0, tile_mib=256),  # four 512-row chunks
    Case(1000, 128256, 4096, torch.bfloat16, "stats", "bias", scale=0.25, bias=True),
    Case(1000, 50257, 768, torch.float32, "nll", "head", bias=True),
    Case(1000, 32001, 896, torch.float16, "stats", "frozen", temperature=0.9),
    Case(1000, 32001, 896, torch.bfloat16, "nll", "head", inputs="spiked"),
    # the entropy gradient of such rows cancels two terms of the size of the far logit's distance from the first
    # tile's largest one (module docstring of ops): checked against fp64 bounds on CPU, not against the stock path
    Case(1000, 32001, 896, torch.bfloat16, "stats", "frozen", inputs="spiked", entropy_grad=False),
]


def make_case_inputs(case: Case, dev: torch.device):
    """Logit std ~4 (peaked rows, like trained LMs), every 10th row ignored, both vocab edges as targets."""
    if case.inputs == "spiked":
        hidden, weight, bias, targets = spiked_inputs(0, case.n, case.v, case.h, case.dtype)
    else:
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(case.n, case.h, generator=g).to(case.dtype)
        weight = (torch.randn(case.v, case.h, generator=g) * (4 / math.sqrt(case.h))).to(case.dtype)
        bias = (torch.randn(case.v, generator=g) * 0.5).to(case.dtype)
        targets = torch.randint(0, case.v, (case.n,), generator=g)
        targets[::10] = -100
        targets[1], targets[2] = 0, case.v - 1
    bias = bias if case.bias else None
    return tuple(None if t is None else t.to(dev) for t in (hidden, weight, bias, targets))


def options(case: Case) -> dict:
    opts = dict(temperature=case.temperature, logit_scale=case.scale, softcap=case.softcap)
    return opts if case.tile_mib is None else {**opts, "tile_mib": case.tile_mib}


def run_ours(case: Case, inputs, backend: str | None = None) -> dict:
    opts = {**options(case), "backend": backend}
    if case.kind == "stats":
        return run_stats(*inputs, case.grads, case.entropy_grad, **opts)
    return run_loss(*inputs, case.grads, case.kind, 1 / 997, **opts)


def run_stock(case: Case, hidden, weight, bias, targets) -> dict:
    """The stock CUDA path: materialized logits in the inputs' dtype, upcast to fp32, autograd."""
    from tests._lm_head_refs import upstream

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(case.grads == "head")
    b = None if bias is None else bias.clone().requires_grad_(case.grads != "frozen")
    x = F.linear(h, w, b)
    z = x.float() * case.scale
    if case.softcap is not None:
        z = case.softcap * torch.tanh(z / case.softcap)
    z = z / case.temperature
    logp_all = torch.log_softmax(z, -1)
    valid = targets >= 0
    logp = torch.where(valid, logp_all.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    entropy = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    top1 = valid & ((x if case.scale > 0 else -x).argmax(1) == targets)
    if case.kind == "stats":
        g_logp, g_ent = (t.to(hidden.device) for t in upstream(case.n))
        ((logp * g_logp).sum() + ((entropy * g_ent).sum() if case.entropy_grad else 0)).backward()
    else:
        weights = logp.detach().exp() if case.kind == "dft" else torch.ones_like(logp)
        (-(logp * weights).sum() / 997).backward()
    return dict(logp=logp.detach(), entropy=entropy.detach(), is_top1=top1, grad_h=h.grad, grad_w=w.grad,
                grad_b=None if b is None else b.grad)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_fp64_and_stock(case, dev):
    inputs = make_case_inputs(case, dev)
    targets = inputs[3]
    valid = targets >= 0
    ref_opts = dict(temperature=case.temperature, scale=case.scale, softcap=case.softcap, grads=case.grads,
                    entropy_grad=case.entropy_grad)  # fmt: skip
    if case.kind != "stats":
        ref_opts.update(loss=case.kind, loss_scale=1 / 997)
    ref = reference(*inputs, rows=256, **ref_opts)
    ours = run_ours(case, inputs)
    stock = run_stock(case, *inputs)
    torch.cuda.synchronize() if dev.type == "cuda" else None
    assert_matches(ours, ref, targets, str(case))  # the per-token bounds
    # no worse than the stock path beyond what separates two results that each meet the bound: the same logits,
    # rounded by GEMMs of other accumulation orders (a tile value may round the other way), folded in fp32
    for name, bound in (("logp", ref.logp_bound), ("entropy", ref.ent_bound)):
        ours_err = (ours[name].double() - getattr(ref, name)).abs()[valid].max()
        stock_err = (stock[name].double() - getattr(ref, name)).abs()[valid].max()
        assert ours_err <= stock_err + 2 * bound[valid].max(), (name, ours_err.item(), stock_err.item())
    # top-1 flags: the stock path's, except where the two largest logits are within the tiles' rounding
    decided = ref.decided & valid
    assert torch.equal(ours["is_top1"][decided], stock["is_top1"][decided])
    assert torch.equal(stock["is_top1"][decided], ref.top1[decided])
    for name in ("grad_h", "grad_w", "grad_b"):
        if ref.grads[name] is None:
            continue
        ours_err, stock_err = rel_norm(ours[name], ref.grads[name]), rel_norm(stock[name], ref.grads[name])
        # both round their GEMM operand once and the result once; the scalar loss also rounds a ⊙ h (dW) and a (db):
        # sqrt(3/2) of the stock path's Frobenius error for independent roundings, 1.3 with the noise of N·H of them
        extra = 1.3 if case.kind != "stats" and name != "grad_h" else 1.05
        assert ours_err <= extra * stock_err + ref.grad_fp32_bounds[name], (name, ours_err, stock_err)


@pytest.mark.parametrize("case", [c for c in CASES if c.kind != "stats" and c.grads == "head"][:2], ids=str)
def test_triton_and_torch_backends_agree(case, dev):
    """The run-time fallback (torch backend) computes what the Triton path does, within the fp64 bounds both meet."""
    inputs = make_case_inputs(case, dev)
    ref = reference(*inputs, rows=256, loss=case.kind, loss_scale=1 / 997, grads=case.grads,
                    temperature=case.temperature, scale=case.scale, softcap=case.softcap)  # fmt: skip
    for backend in ("triton", "torch"):
        assert_matches(run_ours(case, inputs, backend), ref, inputs[3], backend)


@pytest.mark.parametrize("tile_mib", [256, 1024])
def test_scalar_loss_memory_is_bounded(tile_mib, dev):
    """Trainable head, N 4097, Qwen2.5-1.5B's head (V 151936, H 1536), bf16: the scalar loss holds one chunk of
    full-vocabulary rows (``tile_mib``), the fp32 dW and dh it accumulates in the forward and the bf16 gradients it
    returns; the stock path holds the [N, V] logits in bf16 and fp32 and their fp32 gradient."""
    if dev.type != "cuda":
        pytest.skip("CUDA memory statistics")
    case = Case(4097, 151936, 1536, torch.bfloat16, "nll", "head", tile_mib=tile_mib)
    hidden, weight, _, targets = make_case_inputs(case, dev)

    def peak(fn) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def ours():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ops.head_loss(h, w, targets, loss_scale=1 / 997, tile_mib=tile_mib).loss.backward()

    def stock():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        (F.cross_entropy(F.linear(h, w).float(), targets, reduction="sum") / 997).backward()

    n, v, width = case.n, case.v, case.h
    inputs = 2 * (n * width + v * width)  # the clones
    budget = tile_mib * 2**20 + 4 * v * (width + 8) + 4 * n * width + 2 * (v * width + n * width) + inputs
    ours_peak, stock_peak = peak(ours), peak(stock)
    # + the chunk's small temporaries (its fp32 dh GEMM output, a ⊙ h, the reference dot products): < 128 MiB here
    assert ours_peak <= budget + 128 * 2**20, (ours_peak / 2**20, budget / 2**20)
    assert ours_peak < 0.6 * stock_peak, (ours_peak / 2**20, stock_peak / 2**20)


def test_all_rows_ignored_is_a_differentiable_zero(dev):
    """A micro-batch with nothing to score: loss 0 with zero gradients, no launch on garbage, both heads."""
    case = Case(257, 32001, 896, torch.bfloat16, "nll", "head")
    hidden, weight, _, _ = make_case_inputs(case, dev)
    targets = torch.full((case.n,), -100, device=dev)
    for trainable in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        out = ops.head_loss(h, w, targets, loss_scale=1.0)
        out.loss.backward()
        assert out.loss.item() == 0 and (h.grad == 0).all() and not out.is_top1.any() and (out.entropy == 0).all()
        assert (w.grad == 0).all() if trainable else w.grad is None
