"""The padding-free tests' shared pieces (CPU and CUDA): the skip where this transformers / TRL cannot train
padding-free batches as padded ones (the probe's own checks, which the parity tests exercise by forcing them), and
one batch's loss and gradients padded, then padding-free."""

from __future__ import annotations

import pytest
import torch

import leantrain
from leantrain import Status
from leantrain.padding_free import probe as pf_probe
from testkit.optimizations import only


def skip_unless_ready(trainer) -> None:
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    reasons = pf_probe.model_reasons(model) + pf_probe.count_reasons(trainer)
    reasons += pf_probe.collator_reasons(trainer.data_collator)
    if reasons:
        pytest.skip("; ".join(reasons))


def loss_and_grads(trainer, rows) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward of ``rows`` through the trainer's collator, with the token count as training counts
    it (fp32 copies of the loss and gradients)."""
    device = trainer.model.device
    batch = {k: v.to(device) for k, v in trainer.data_collator(rows).items() if torch.is_tensor(v)}
    _, count = trainer.get_batch_samples(iter([batch]), 1, device)
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=count)
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def padded_then_packed(
    trainer, rows, also: str | None = None, **options
) -> tuple[tuple[torch.Tensor, dict], tuple[torch.Tensor, dict]]:
    """``loss_and_grads`` of the padded batch, then of the padding-free one (``padding_free`` applied, then undone),
    ``also`` (another optimization's name) required in both, with ``options``: the trainer must be ready
    (``skip_unless_ready``)."""
    skip_unless_ready(trainer)
    with_also = {also: True} if also else {}
    if also:
        leantrain.patch_trainer(trainer, **only(also), **options)
    padded = loss_and_grads(trainer, rows)
    if also:
        leantrain.unpatch_trainer(trainer)
    report = leantrain.patch_trainer(trainer, **{**only("padding_free"), **with_also}, **options)
    assert report["padding_free"].status is Status.APPLIED, report["padding_free"].reasons
    assert all(report[name].status is Status.APPLIED for name in with_also), report
    assert trainer.data_collator(rows)["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows))
    packed = loss_and_grads(trainer, rows)
    leantrain.unpatch_trainer(trainer)
    assert trainer.data_collator.padding_free is False
    return padded, packed
