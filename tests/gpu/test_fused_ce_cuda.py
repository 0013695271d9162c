"""The fused loss on CUDA (leantrain's Triton op) vs the stock CUDA path, on a tiny model: SFTTrainer on the TRL path
the installed TRL takes (its fused head on >= 1.15, chunked_nll / nll / dft on <= 1.14) and a plain Trainer, in fp32
(TF32 off) and bf16 autocast; softcapped and tied heads; and the memory the full logits cost stock (the patched step
builds no [B, T, V] logits).

Bounds as on CPU (``tests/parity/test_fused_ce_sft.py``): V·u in fp32 (sums over the vocabulary rounded in another
order), 4u in bf16 (one rounding of each logit and one of each probability in the gradient, per side; 8u against
TRL <= 1.14's dft_loss, whose log-softmax runs in bf16)."""

from __future__ import annotations

import copy

import pytest
import torch

import leantrain
from leantrain.report import Status
from tests._fused_ce_trainers import (
    OFF,
    UNIT_ROUNDOFF,
    VOCAB,
    assert_accuracy,
    assert_window_close,
    batches_of,
    greedy_rows,
    plain_trainer,
    sft_paths,
    sft_trainer,
    spy_op,
    tiny,
    window,
)
from tests.gpu._device import DEVICE, dev_fixture, needs_device  # noqa: F401 (the "dev" fixture)


pytest.importorskip("trl")
pytest.importorskip("datasets")
pytestmark = needs_device
ON_CUDA = DEVICE == "cuda"
KERNEL = "triton" if ON_CUDA else "torch"  # LEANTRAIN_TEST_DEVICE=cpu (with --noconftest) checks the logic on CPU

FP32 = VOCAB * UNIT_ROUNDOFF[torch.float32]
BF16 = 4 * UNIT_ROUNDOFF[torch.bfloat16]


# The tiny heads here are outside every measured cell (auto mode keeps the stock loss there): request the op.
ON = {**OFF, "fused_ce": True}


def sft_pair(dev, tmp_path, model, loss_type, **args):
    rows = greedy_rows()
    model = model.to(dev)
    patched = sft_trainer(model, tmp_path / "p", rows, loss_type=loss_type, **args)
    stock = sft_trainer(copy.deepcopy(model), tmp_path / "s", rows, loss_type=loss_type, **args)
    return patched, stock, leantrain.patch_trainer(patched, **ON)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("loss_type", "path"), sft_paths())
def test_sft_window(dev, tmp_path, monkeypatch, loss_type, path, bf16):
    backends = spy_op(monkeypatch)
    patched, stock, report = sft_pair(dev, tmp_path, tiny(), loss_type, bf16=bf16, gradient_accumulation_steps=2)
    assert report["fused_ce"].status is Status.APPLIED, report["fused_ce"].reasons
    assert f"kernel: {KERNEL if ON_CUDA else 'torch chunked'}" in report["fused_ce"].detail
    batches = batches_of(stock, 2)
    ours, ref = window(patched, batches), window(stock, batches)
    assert backends and set(backends) == {KERNEL}
    bound = (2 * BF16 if path == "dft" else BF16) if bf16 else FP32
    assert_window_close(ours, ref, bound, bound)
    if not bf16:
        assert_accuracy(ours, ref)
    else:  # near-tied top logits may flip in bf16: at most one token per micro-batch here
        assert_accuracy(ours, ref, [1.0 / int((b["labels"] != -100).sum()) for b in batches])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_trainer_window(dev, tmp_path, monkeypatch, bf16):
    backends = spy_op(monkeypatch)
    model = tiny().to(dev)
    rows = greedy_rows()
    patched = plain_trainer(model, tmp_path / "p", rows, bf16=bf16, gradient_accumulation_steps=2)
    stock = plain_trainer(copy.deepcopy(model), tmp_path / "s", rows, bf16=bf16, gradient_accumulation_steps=2)
    assert leantrain.patch_trainer(patched, **ON)["fused_ce"].status is Status.APPLIED
    batches = batches_of(stock, 2)
    ours, ref = window(patched, batches), window(stock, batches)
    assert set(backends) == {KERNEL}
    assert_window_close(ours, ref, BF16 if bf16 else FP32)


@pytest.mark.parametrize(
    ("family", "overrides"), [("gemma2", {}), ("llama", {"tie_word_embeddings": True})], ids=["gemma2", "tied"]
)
def test_heads(dev, tmp_path, family, overrides):
    loss_type, _ = sft_paths()[0]
    model = tiny(family, **overrides)
    model.tie_weights()
    patched, stock, report = sft_pair(dev, tmp_path, model, loss_type, bf16=True)
    assert report["fused_ce"].status is Status.APPLIED
    batches = batches_of(stock, 1)
    ours, ref = window(patched, batches), window(stock, batches)
    assert_window_close(ours, ref, BF16, BF16)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA memory statistics")
@pytest.mark.parametrize(
    ("vocab", "hidden", "width", "frozen"),
    [(32768, 64, 256, False), (256000, 2304, 2048, True)],
    ids=["V32768-full", "gemma2-2b-head-frozen"],
)
def test_no_full_logits_in_memory(dev, tmp_path, vocab, hidden, width, frozen):
    """A plain Trainer step, bf16 autocast, 4 rows of ``width`` tokens: stock holds the bf16 logits and their fp32
    copy (N·V·6 bytes; 12 GiB at Gemma-2-2B's head, 4 x 2048 tokens) from the forward to the backward; the patched
    step's peak stays below stock's by at least that (the small case: by half of it, its tile is a larger share).
    The Gemma-2-2B-shaped case has one decoder layer and a frozen embedding and head, as under LoRA."""
    from leantrain.cli.tiny import tiny_model

    dtype = torch.bfloat16 if frozen else torch.float32
    model = tiny_model("llama", vocab_size=vocab, hidden=hidden, layers=1 if frozen else 2, dtype=dtype)
    model = model.train().to(dev)
    if frozen:
        model.get_input_embeddings().weight.requires_grad_(False)
        model.get_output_embeddings().weight.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, vocab, (width,), generator=g).tolist() for _ in range(4)]
    patched = plain_trainer(model, tmp_path / "p", rows, bf16=True)
    stock = plain_trainer(copy.deepcopy(model), tmp_path / "s", rows, bf16=True)
    assert leantrain.patch_trainer(patched, **ON)["fused_ce"].status is Status.APPLIED
    batch = batches_of(stock, 1)[0]

    def peak(trainer) -> int:
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        trainer.training_step(trainer.model, {k: v.clone() for k, v in batch.items()}, None)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    peak(stock), peak(patched)  # warm-up: workspaces, gradients allocated once
    stock_peak, patched_peak = peak(stock), peak(patched)
    logits_bytes = batch["input_ids"].numel() * vocab * 6
    margin = logits_bytes if frozen else logits_bytes // 2
    gib = f"stock {stock_peak / 2**30:.2f} GiB, leantrain {patched_peak / 2**30:.2f} GiB"
    assert patched_peak < stock_peak - margin, gib
