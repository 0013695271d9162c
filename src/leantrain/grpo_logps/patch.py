"""The wrappers ``apply`` installs: leantrain's op in TRL's fused-head forward protocol.

TRL >= 1.15: ``add_fused_lm_head`` rebinds ``forward`` on the (PEFT base) model instance; with ``fused_lm_head=True``
it runs the backbone and ``ChunkedLogProbFunction``. We wrap that same instance attribute: fused calls run the
backbone exactly as TRL does and then leantrain's op, returning TRL's ``FusedCausalLMOutput``; all other calls (and
every call after a run-time failure) go to TRL's forward, and so do no-grad calls where TRL's head measured faster
(``nograd.py``). The trainer keeps calling the accelerator-wrapped module, so DDP/FSDP gradient sync is untouched.

TRL <= 1.14 (a full-logits method returning 2 or 3 values: ``_get_per_token_logps_and_entropies`` in 0.2x-1.13 and
in RLOO, ``_full_logits_logps`` behind it in GRPO 1.14): we install the same ``fused_lm_head`` forward protocol on the
base model ourselves and replace that method (text-only calls; any other call goes to the original) with one that
calls the wrapped model with ``fused_lm_head=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import trl_head
from ..fallback import RuntimeFallback
from ..lm_head import ops
from ..trl_head import HeadSettings
from . import nograd


__all__ = ["HeadSettings", "FusedCall", "fused_forward", "make_forward", "run_op"]


@dataclass
class FusedCall:
    """Everything the fused forward needs besides the model: settings, the op runner, and whether the forward it
    wraps is TRL's fused head (TRL >= 1.15: no-grad calls may go to it; TRL <= 1.14's own forward is full logits)."""

    settings: HeadSettings
    # run_op(settings, hidden, weight, targets, need_entropy, entropy_grad) -> (logp, entropy)
    run_op: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    entropy_grad: Callable[[], bool]
    trl_head: bool


@dataclass
class _FusedOutput:
    """TRL's ``FusedCausalLMOutput`` fields, for TRL <= 1.14 (which has no such class; only our method reads it)."""

    loss: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    label_mask: torch.Tensor
    aux_loss: torch.Tensor | None = None


def _output_class() -> Callable[..., Any]:
    try:
        from trl.trainer.utils import FusedCausalLMOutput
    except ImportError:  # TRL <= 1.14
        return _FusedOutput
    return FusedCausalLMOutput


def uses_trl_head(model: nn.Module, call: FusedCall) -> bool:
    """Whether this ``fused_lm_head=True`` call goes to TRL's own fused forward instead of the op: no gradient
    wanted, TRL's fused head underneath, and the no-grad rule says so for this head."""
    if torch.is_grad_enabled() or not call.trl_head:
        return False
    found = trl_head.head_shape(model)
    return found is not None and nograd.trl_head_serves(found[1], ops.default_backend(found[0].device))


def fused_forward(model: nn.Module, call: FusedCall, *args: Any, **kwargs: Any):
    """TRL's ``fused_lm_head=True`` forward with leantrain's op in place of ``ChunkedLogProbFunction``."""
    st = call.settings
    backbone_out, hidden, labels, num_items_in_batch = trl_head.backbone_pass(
        model, st.backbone_attr, st.text_config, args, kwargs
    )
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise RuntimeError("LM head has a bias")  # the probe declines these; reaching here means the model changed
    need_entropy = "entropy" in st.outputs
    entropy_grad = need_entropy and call.entropy_grad()
    with trl_head.head_rows(model, st, hidden, labels) as rows:
        mask = rows.mask
        logp, entropy = call.run_op(st, rows.hidden[mask], rows.weight, rows.targets[mask], need_entropy, entropy_grad)
    log_probs, entropy = trl_head.scatter(mask, logp), trl_head.scatter(mask, entropy)
    denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / denom
    loss, aux_loss = trl_head.with_aux_loss(model, st, backbone_out, kwargs, loss)
    output = _output_class()
    return output(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)


# ----------------------------------------------------------------------------------------------- TRL <= 1.14
def legacy_method(trainer: Any, original: Callable[..., Any], n_values: int) -> Callable[..., Any]:
    """The replacement for TRL <= 1.14's ``_get_per_token_logps_and_entropies`` (text-only calls)."""

    def method(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **extra):
        if any(v is not None and v is not False for v in extra.values()):  # multimodal / aux-loss calls: stock
            return original(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **extra)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start : start + batch_size]
            att = attention_mask[start : start + batch_size]
            labels = ids.masked_fill(att == 0, -100)
            labels[:, :-logits_to_keep] = -100
            # No autocast of our own: the stock method runs the model in its caller's context (as TRL does)
            out = model(input_ids=ids, attention_mask=att, labels=labels, fused_lm_head=True)
            logps.append(out.log_probs[:, -logits_to_keep:])
            if compute_entropy:  # the reference model's head computes no entropy
                entropies.append(out.entropy[:, -logits_to_keep:])
        result = (torch.cat(logps), torch.cat(entropies) if compute_entropy else None)
        return result if n_values == 2 else (*result, None)

    return method


# ------------------------------------------------------------------------------- what apply() binds
def entropy_grad(trainer: Any) -> Callable[[], bool]:
    # TRL's entropy bonus needs the entropy's gradient; otherwise it is only logged/masked
    return lambda: bool(getattr(trainer, "_entropy_bonus_enabled", False))


def make_forward(model: nn.Module, call: FusedCall, fallback: RuntimeFallback | None, original: Callable[..., Any]):
    fast = functools.partial(fused_forward, model, call)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("fused_lm_head", False):
            return original(*args, **kwargs)
        if uses_trl_head(model, call):
            return original(*args, **kwargs)
        if fallback is None:
            return fast(*args, **kwargs)
        return fallback.call(fast, original, *args, **kwargs)

    return forward


def guarded(fallback: RuntimeFallback, fast: Callable[..., Any], stock: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: fallback.call(fast, stock, *args, **kwargs)


def run_op(
    guard: RuntimeFallback,
    tile_mib: int,
    keep_logits_mib: int,
    st: HeadSettings,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    need_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op on the best backend; a Triton failure falls back to the torch chunked path (warned once)."""

    def run(backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return ops.logp_entropy(
            hidden,
            weight,
            targets,
            need_entropy=need_entropy,
            entropy_grad=entropy_grad,
            tile_mib=tile_mib,
            backend=backend,
            keep_logits_mib=keep_logits_mib,
            **trl_head.head_options(st, weight),
        )

    return trl_head.run_op(guard, hidden.device, run)
