"""Padding-free batches on CUDA against the trainer's padded batches on CUDA (SDPA attention).

The packed row runs other attention kernels than the padded rows (a mask built from the position ids against a
padding mask), so the two agree to the rounding of differently tiled reductions, not bitwise. fp32 (TF32 off, torch's
default for matmuls): the loss within 64 ulps; each gradient tensor within 1e-4 of its largest entry (~840 ulps:
room for the kernels' other summation orders, while a row attending to another moves a gradient by its own size,
which the CPU test shows). bf16: the loss within 4 bf16 ulps. Then the trainer's own steps: the same losses.

bf16 on CUDA is the varlen plan: the model's SDPA swapped for torch's flash attention over the rows' boundaries.
Against the padded batch (SDPA's memory-efficient kernel over a padding mask): the loss within 4 bf16 ulps; each
gradient tensor within 8 bf16 ulps (6%) of its largest entry: both runs round every activation and gradient to bf16
between kernels that tile their sums differently, while a row attending to another moves a gradient by its own size."""

from __future__ import annotations

import pytest
import torch

import leantrain
from leantrain import Status
from leantrain.cli.tiny import tiny_model
from testkit.batches import random_rows
from testkit.optimizations import only


pytestmark = pytest.mark.gpu
pytest.importorskip("trl")
pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

from leantrain.padding_free import patch as pf_patch  # noqa: E402
from tests._fused_ce_trainers import sft_trainer  # noqa: E402
from tests._padding_free import padded_then_packed, skip_unless_ready  # noqa: E402


VOCAB = 512
LENGTHS = (37, 120, 64, 9, 101, 75, 18, 128)


def trainer_for(tmp_path, dtype: torch.dtype, **args):
    model = tiny_model("llama", vocab_size=VOCAB, dtype=dtype).to("cuda")
    model.config._attn_implementation = "sdpa"
    lora = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, lora)
    rows = [r["input_ids"] for r in random_rows(len(LENGTHS), LENGTHS, VOCAB)]
    bf16 = dtype == torch.bfloat16
    return sft_trainer(model.train(), tmp_path, rows, per_device_train_batch_size=4, max_steps=2, bf16=bf16, **args)


@pytest.mark.parametrize(
    ("dtype", "also"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "fused_ce"), (torch.float32, "compile_layers")],
)
def test_loss_and_gradients_equal_the_padded_batch_on_cuda(tmp_path, dtype, also):
    """Alone, and with the fused loss or the compiled layers in both runs (what auto mode applies beside it)."""
    trainer = trainer_for(tmp_path, dtype)
    rows = [trainer.train_dataset[i] for i in range(4)]
    (padded_loss, padded), (loss, grads) = padded_then_packed(trainer, rows, also)
    eps = torch.finfo(dtype).eps
    assert torch.allclose(loss, padded_loss, rtol=(64 if dtype == torch.float32 else 4) * eps, atol=0)
    if dtype == torch.float32:
        assert grads.keys() == padded.keys() and grads
        for name, grad in grads.items():
            scale = padded[name].abs().max()
            assert scale > 0 and (grad - padded[name]).abs().max() <= 1e-4 * scale, name


def test_training_steps_match_the_padded_run_on_cuda(tmp_path):
    losses = {}
    for variant in ("padded", "padding_free"):
        trainer = trainer_for(tmp_path / variant, torch.float32, optim="sgd", learning_rate=0.5)
        skip_unless_ready(trainer)
        leantrain.patch_trainer(trainer, **only("padding_free", variant == "padding_free"))
        trainer.train()
        losses[variant] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        leantrain.unpatch_trainer(trainer)
    eps = torch.finfo(torch.float32).eps
    assert len(losses["padded"]) == 2 and losses["padding_free"] == pytest.approx(losses["padded"], rel=256 * eps)


@pytest.mark.parametrize("also", [None, "fused_ce", "compile_layers"])
def test_varlen_flash_attention_equals_the_padded_batch_on_cuda(tmp_path, also):
    trainer = trainer_for(tmp_path, torch.bfloat16)
    report = leantrain.patch_trainer(trainer, **only("padding_free"))
    if "flash attention over the rows' boundaries" not in report["padding_free"].detail:
        pytest.skip(report["padding_free"].detail)
    leantrain.unpatch_trainer(trainer)
    rows = [trainer.train_dataset[i] for i in range(4)]
    seen = []
    kernel = pf_patch.VARLEN
    pf_patch.VARLEN = lambda *a: seen.append(a[0].shape) or kernel(*a)
    try:
        (padded_loss, padded), (loss, grads) = padded_then_packed(trainer, rows, also)
    finally:
        pf_patch.VARLEN = kernel
    assert seen or also == "compile_layers"  # a compiled layer calls the kernel from its graph
    eps = torch.finfo(torch.bfloat16).eps
    assert torch.allclose(loss, padded_loss, rtol=4 * eps, atol=0), (loss, padded_loss)
    assert grads.keys() == padded.keys() and grads
    worst = max(float((g - padded[n]).abs().max() / padded[n].abs().max()) for n, g in grads.items())
    print(f"varlen vs padded, bf16, {also}: loss {float(loss):.6f} vs {float(padded_loss):.6f}; worst gradient "
          f"{worst:.4f} of its largest entry")  # fmt: skip
    assert worst <= 8 * eps


def test_auto_mode_applies_it_on_cuda_where_the_padded_batches_carry_padding(tmp_path):
    """bf16 on CUDA with the varlen plan: auto mode turns it on for LENGTHS (about a third of a padded batch of 4 is
    padding) and leaves rows of one length padded, saying the share it estimated."""
    varying = trainer_for(tmp_path / "varying", torch.bfloat16)
    skip_unless_ready(varying)
    outcome = leantrain.patch_trainer(varying, **only("padding_free", None))["padding_free"]
    if "flash attention over the rows' boundaries" not in outcome.detail:
        pytest.skip(outcome.detail or "; ".join(outcome.reasons))
    assert outcome.status is Status.APPLIED, outcome.reasons
    assert varying.model.config._attn_implementation == pf_patch.ATTENTION
    leantrain.unpatch_trainer(varying)
    model = tiny_model("llama", vocab_size=VOCAB, dtype=torch.bfloat16).to("cuda")
    model.config._attn_implementation = "sdpa"
    rows = [r["input_ids"] for r in random_rows(8, (64,) * 8, VOCAB)]
    same = sft_trainer(model.train(), tmp_path / "same", rows, per_device_train_batch_size=4, max_steps=2, bf16=True)
    outcome = leantrain.patch_trainer(same, **only("padding_free", None))["padding_free"]
    assert outcome.status is Status.SKIPPED and "would hold 0% padding" in " ".join(outcome.reasons)
    leantrain.unpatch_trainer(same)
