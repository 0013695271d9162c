"""TRL <= 1.14's ``SFTTrainer.compute_loss`` on the full-logits paths (``loss_type="nll"`` and ``"dft"``), with the
loss, entropy and token accuracy from the fused forward's per-position outputs instead of the ``[B, T, V]`` logits.

It computes and logs what that TRL's own method does (the probe reads which variant from its source, see
``probe.sft_variant``): the model's loss (or TRL's ``dft_loss``) with the Trainer's cross-device scaling, the
``entropy`` metric over every attended position (TRL 0.x) or over the labelled ones (1.x), ``mean_token_accuracy``
over the labelled ones, ``num_tokens`` and the MoE ``aux_loss``. Calls that return logits to an evaluation loop run
TRL's own method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..fallback import RuntimeFallback
from .patch import REQUEST_KEY, Request
from .probe import SftVariant


def make_compute_loss(
    trainer: Any, variant: SftVariant, fallback: RuntimeFallback, original: Callable[..., Any]
) -> Callable[..., Any]:
    def fast(model, inputs, return_outputs=False, num_items_in_batch=None):
        return compute_loss(trainer, variant, model, inputs, return_outputs, num_items_in_batch)

    def wrapped(model, inputs, return_outputs=False, num_items_in_batch=None):
        # prediction_step marks whether the evaluation loop reads the logits (TRL's `_prediction_loss_only`)
        if (return_outputs and inputs.get("_prediction_loss_only") is not True) or "labels" not in inputs:
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        return fallback.call(fast, original, model, inputs, return_outputs, num_items_in_batch)

    return wrapped


def compute_loss(trainer: Any, variant: SftVariant, model, inputs, return_outputs=False, num_items_in_batch=None):
    mode = "train" if trainer.model.training else "eval"
    inputs = dict(inputs)  # the stock fallback gets the caller's dict as it was
    inputs.pop("_prediction_loss_only", None)
    inputs["use_cache"] = False
    if variant.router_input and trainer.aux_loss_enabled:
        inputs["output_router_logits"] = True
    kwargs = {}
    if trainer.model_accepts_loss_kwargs and num_items_in_batch is not None:
        kwargs["num_items_in_batch"] = num_items_in_batch
    request = Request(entropy=variant.entropy_scope, top1=True)
    if variant.dft:  # Trainer hands the labels and num_items_in_batch to compute_loss_func, not to the model
        request.loss, request.labels, request.num_items = "dft", inputs.pop("labels"), num_items_in_batch
        request.clamp = variant.dft_clamp
    outputs = model(**inputs, **kwargs, **{REQUEST_KEY: request})
    loss = _scale_like_trainer(trainer, outputs.loss, num_items_in_batch)

    metrics = trainer._metrics[mode]
    gather = trainer.accelerator.gather_for_metrics
    if variant.entropy_scope == "attention":
        metrics["entropy"].append(_entropy_over_attention(outputs, inputs, gather))
    else:
        entropy, accuracy = _entropy_and_accuracy(outputs, gather)
        metrics["entropy"].append(entropy)
        metrics["mean_token_accuracy"].append(accuracy)
    if mode == "train":
        if "attention_mask" in inputs:
            num_tokens = gather(inputs["attention_mask"].sum()).sum().item()
        elif "position_ids" in inputs:
            local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
            num_tokens = gather(local).sum().item()
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        trainer._total_train_tokens += num_tokens // getattr(trainer, "_tp_size", 1)
    metrics["num_tokens"] = [trainer._total_train_tokens]
    if variant.entropy_scope == "attention":
        metrics["mean_token_accuracy"].append(_accuracy(outputs, gather))
    if trainer.aux_loss_enabled:
        metrics["aux_loss"].append(gather(outputs.aux_loss).mean().item())
    return (loss, outputs) if return_outputs else loss


def _scale_like_trainer(trainer: Any, loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    """``Trainer.compute_loss``'s cross-device scaling (tensor parallelism and DataParallel are declined)."""
    args = trainer.args
    if (
        args.average_tokens_across_devices
        and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func)
        and num_items_in_batch is not None
    ):
        loss = loss * trainer.accelerator.num_processes
    return loss


@torch.no_grad()
def _entropy_over_attention(outputs: Any, inputs: dict, gather: Callable) -> float:
    per_token_entropy = outputs.entropy
    if "attention_mask" in inputs:
        attention_mask = inputs["attention_mask"]
        entropy = torch.sum(per_token_entropy * attention_mask) / attention_mask.sum()
    elif "position_ids" in inputs:
        entropy = torch.mean(per_token_entropy)
    else:
        raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
    return gather(entropy).mean().item()


@torch.no_grad()
def _accuracy(outputs: Any, gather: Callable) -> float:
    mask = outputs.label_mask
    correct_tokens = gather((outputs.is_top1 & mask).sum())
    total_tokens = gather(mask.sum())
    total_sum = total_tokens.sum()
    return (correct_tokens.sum() / total_sum).item() if total_sum > 0 else 0.0


@torch.no_grad()
def _entropy_and_accuracy(outputs: Any, gather: Callable) -> tuple[float, float]:
    mask = outputs.label_mask
    entropy_sum = gather((outputs.entropy * mask).sum()).sum()
    total_tokens = gather(mask.sum()).sum()
    correct_tokens = gather((outputs.is_top1 & mask).sum())
    entropy = (entropy_sum / total_tokens).item() if total_tokens > 0 else 0.0
    total_sum = total_tokens.sum()
    accuracy = (correct_tokens.sum() / total_sum).item() if total_sum > 0 else 0.0
    return entropy, accuracy
