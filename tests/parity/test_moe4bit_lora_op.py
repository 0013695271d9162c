"""Split LoRA as grouped GEMMs (``leantrain.moe4bit.lora``) against a per-expert loop: output, dX, dA, dB.
CPU, seeded. fp32 on CPU: each expert's rows go through the same ``mm`` calls in the same order in both paths,
so the results are compared exactly where that holds and within fp32 rounding of the scale otherwise."""

from __future__ import annotations

import pytest
import torch

from leantrain.moe4bit.lora import LoraFactors, padded_rank, split_lora


def loop_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, scaling: float) -> torch.Tensor:
    """The per-expert reference: ``(x_e @ A_e^T) @ B_e^T * s`` per group (host loop; test only)."""
    parts, start = [], 0
    for e, end in enumerate(offs.tolist()):
        parts.append((x[start:end] @ a[e].t()) @ b[e].t() * scaling)
        start = end
    return torch.cat(parts)


def case(rank: int, dtype=torch.float32, experts: int = 5, rows=(7, 0, 12, 3, 10), inp: int = 64, out: int = 48):
    torch.manual_seed(rank)
    offs = torch.tensor(rows, dtype=torch.int32).cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]), inp, dtype=dtype)
    a = (torch.randn(experts, rank, inp) * 0.2).to(dtype)
    b = (torch.randn(experts, out, rank) * 0.2).to(dtype)
    return x, a, b, offs


def grads(fn, x, a, b, gy):
    x, a, b = (t.detach().clone().requires_grad_(True) for t in (x, a, b))
    y = fn(x, a, b)
    y.backward(gy)
    return y.detach(), x.grad, a.grad, b.grad


@pytest.mark.parametrize("rank", [16, 4, 3])  # fp32: 16 and 4 are aligned (16 B rows), 3 is padded to 4
def test_split_lora_matches_loop_fp32(rank):
    x, a, b, offs = case(rank)
    gy = torch.randn(x.shape[0], b.shape[1])
    ours = grads(lambda x, a, b: split_lora(x, LoraFactors(a, b, 2.0), offs), x, a, b, gy)
    ref = grads(lambda x, a, b: loop_lora(x, a, b, offs, 2.0), x, a, b, gy)
    for name, o, r in zip(("y", "dx", "da", "db"), ours, ref):
        if padded_rank(rank, torch.float32) == rank:  # the same mm per group in the same order: bit-identical
            assert torch.equal(o, r), name
            continue
        # a padded rank adds zero terms to the rank-sum, which changes how the CPU GEMM blocks it: a few ulps of
        # the quantity's scale (sums of <= 64 terms: 64 * eps * scale)
        tol = 64 * torch.finfo(torch.float32).eps * max(1.0, r.abs().max().item())
        assert torch.allclose(o, r, rtol=0, atol=tol), (name, (o - r).abs().max().item(), tol)
    assert torch.equal(ours[2][1], torch.zeros_like(ours[2][1]))  # the empty expert gets exact zero dA
    assert torch.equal(ours[3][1], torch.zeros_like(ours[3][1]))


@pytest.mark.parametrize("rank", [16, 4])
def test_split_lora_bf16_within_rounding(rank):
    x, a, b, offs = case(rank, torch.bfloat16)
    gy = torch.randn(x.shape[0], b.shape[1], dtype=torch.bfloat16)
    ours = grads(lambda x, a, b: split_lora(x, LoraFactors(a, b, 0.5), offs), x, a, b, gy)
    ref = grads(lambda x, a, b: loop_lora(x.float(), a.float(), b.float(), offs, 0.5), x, a, b, gy.float())
    for name, o, r in zip(("y", "dx", "da", "db"), ours, ref):
        # bf16 inputs, fp32 reference: two chained GEMMs each rounding once to bf16 (rel eps 2**-8) plus the
        # scale's rounding -> 4 eps of the quantity's max magnitude
        tol = 4 * 2**-8 * r.abs().max().item()
        assert (o.float() - r).abs().max().item() <= tol, name


def test_rank_padding_rule():
    assert padded_rank(16, torch.bfloat16) == 16
    assert padded_rank(4, torch.bfloat16) == 8  # 8 bytes per row: padded to 16 bytes
    assert padded_rank(4, torch.float32) == 4
    assert padded_rank(3, torch.float32) == 4


def test_dropout_masks_rows_in_training_only():
    x, a, b, offs = case(8)
    lora = LoraFactors(a, b, 1.0, dropout=0.5)
    assert torch.equal(split_lora(x, lora, offs, training=False), split_lora(x, LoraFactors(a, b, 1.0), offs))
    torch.manual_seed(0)
    y = split_lora(x, lora, offs, training=True)
    torch.manual_seed(0)
    kept = torch.nn.functional.dropout(x, 0.5, training=True)  # the same draw: one dropout over all rows
    assert torch.equal(y, split_lora(kept, LoraFactors(a, b, 1.0), offs))


def test_regathered_source_gives_identical_gradients():
    """``source=(tokens, index)``: backward re-gathers the rows instead of keeping them; bit-identical results."""
    torch.manual_seed(0)
    tokens = torch.randn(9, 64)
    index = torch.tensor([0, 3, 3, 8, 1, 2, 5, 5, 7, 6, 4, 0, 2, 1])
    offs = torch.tensor([4, 4, 9, 14], dtype=torch.int32)
    a, b = torch.randn(4, 8, 64) * 0.2, torch.randn(4, 32, 8) * 0.2
    gy = torch.randn(14, 32)
    results = []
    for source in (None, "tokens"):
        t = tokens.clone().requires_grad_(True)
        x = t.index_select(0, index)
        aa, bb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        y = split_lora(x, LoraFactors(aa, bb, 0.5), offs, source=None if source is None else (t, index))
        y.backward(gy)
        results.append((y.detach(), t.grad, aa.grad, bb.grad))
    for ours, ref in zip(*results):
        assert torch.equal(ours, ref)
