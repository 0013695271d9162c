"""The fused loss's trainer glue: the forwards and loss wrappers ``apply`` installs.

Every path runs the model's decoder trunk as the stock forward does, then leantrain's op on the last hidden states
and the head weight (``leantrain.lm_head``): per-token log-probs, entropies and whether the label is the argmax,
never the ``[B, T, V]`` logits. Whatever reads labels (the shift, the mask) reads them after the trunk ran, so labels
that CGGR masks inside the forward feed the loss.

- TRL's own forwards (``trl_fused``: ``fused_lm_head=True`` calls; ``chunked_nll``: calls with labels) are wrapped on
  the model instance and return TRL's own output class, so TRL's ``compute_loss`` runs unchanged. A run-time failure
  falls back to TRL's forward.
- The full-logits paths install a forward that answers a ``REQUEST_KEY`` keyword (a :class:`Request`) and leaves
  every other call to the model's own forward; the trainer's ``compute_loss`` passes that keyword (plain Trainer) or
  is replaced by the same loss and metrics from its outputs (``legacy.py``, TRL <= 1.14). A run-time failure falls
  back to the stock ``compute_loss``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from .. import trl_head
from ..fallback import RuntimeFallback
from ..lm_head import ops
from ..trl_head import IGNORE_INDEX, HeadSettings


REQUEST_KEY = "leantrain_fused_ce"
__all__ = ["HeadSettings", "IGNORE_INDEX", "REQUEST_KEY", "run_op", "score"]


@dataclass
class Request:
    """What one fused forward call computes (the ``REQUEST_KEY`` keyword)."""

    entropy: str | None = None  # None, "labels" (labelled positions) or "attention" (every attended position)
    top1: bool = False
    # "nll": the model's own loss (the sum over labelled positions / num_items_in_batch, else their mean) plus its
    # MoE aux loss; "dft": TRL's dft_loss (over ``num_items``, else the label count, clamped to >= 1 if ``clamp``)
    loss: str = "nll"
    labels: torch.Tensor | None = None  # labels the caller kept out of the model's inputs (dft)
    num_items: Any = None  # dft: the normalizer Trainer hands to compute_loss_func
    clamp: bool = False


@dataclass
class ModelParts:
    """The model-side settings a request forward needs (from the probe)."""

    settings: HeadSettings
    moe: bool  # the forward takes output_router_logits
    aux_loss: Callable[..., torch.Tensor] | None  # the model module's load_balancing_loss_func


@dataclass
class FusedCeOutput(ModelOutput):
    """The model's outputs on the fused path: no logits; per-token values aligned with the input positions (the
    last position, which predicts nothing, is masked)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    router_logits: Any = None
    hidden_states: Any = None
    attentions: Any = None


@dataclass
class TokenStats:
    log_probs: torch.Tensor  # fp32, 0 where the label is ignored
    entropy: torch.Tensor | None  # fp32, 0 outside the scored rows
    is_top1: torch.Tensor | None  # bool, False where the label is ignored
    label_mask: torch.Tensor
    loss: torch.Tensor | None = None  # the scalar loss, when asked for


# ---------------------------------------------------------------------------------------------------- the op
@dataclass(frozen=True)
class LossSpec:
    """The scalar loss the op computes with its gradient: ``Σ w_i·(-logp_i)``, ``w_i = scale`` ("nll") or
    ``scale·p_i`` with ``p_i`` a constant ("dft"); ``scale`` is ``1 / normalizer`` (a 0-dim tensor: no host sync)."""

    loss_type: str
    scale: torch.Tensor


def run_op(
    guard: RuntimeFallback,
    tile_mib: int,
    st: HeadSettings,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    need_entropy: bool,
    need_top1: bool,
    loss: LossSpec | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, logp, entropy, is_top1) of the rows on the best backend; a Triton failure falls back to the torch
    path. With ``loss``, the op's scalar loss (``ops.head_loss``: 3 GEMMs for a trainable head) carries the gradient
    and the per-token values come back detached; without, ``logp`` itself is differentiable (``ops.token_stats``)."""
    options = dict(bias=bias, need_entropy=need_entropy, need_top1=need_top1, tile_mib=tile_mib)
    options.update(trl_head.head_options(st, weight, bias))

    def run(backend: str):
        if loss is None:
            return (None, *ops.token_stats(hidden, weight, targets, backend=backend, **options))
        out = ops.head_loss(
            hidden, weight, targets, loss_type=loss.loss_type, loss_scale=loss.scale, backend=backend, **options
        )
        return out.loss, out.logp, out.entropy, out.is_top1

    return trl_head.run_op(guard, hidden.device, run)


def inverse(normalizer: Any, device: torch.device) -> torch.Tensor:
    """``1 / normalizer`` as a 0-dim fp32 tensor on ``device`` (an int, or a tensor: no host sync)."""
    return 1.0 / torch.as_tensor(normalizer, device=device).to(torch.float32)


def score(
    model: nn.Module,
    st: HeadSettings,
    op: Callable[..., Any],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    loss: Callable[[torch.Tensor], LossSpec] | None = None,
    entropy_rows: torch.Tensor | None = None,
    need_entropy: bool = True,
    need_top1: bool = True,
) -> TokenStats:
    """Per-position log-probs (entropies, argmax tests) of ``targets`` [B, T] from ``hidden`` [B, T, H], and the
    scalar loss when ``loss`` gives its spec from the label mask.

    The op sees the labelled rows only (``hidden[mask]``, as TRL's head on CUDA). ``entropy_rows``: positions whose
    entropy is wanted without a label (TRL 0.x logs it over every attended position); a no-grad call scores those."""
    with trl_head.head_rows(model, st, hidden, targets) as rows:
        mask, hidden, targets = rows.mask, rows.hidden, rows.targets
        spec = None if loss is None else loss(mask)
        value, logp, entropy, top1 = op(
            st, hidden[mask], rows.weight, rows.bias, targets[mask], need_entropy, need_top1, spec
        )
        extra = None
        if entropy_rows is not None:
            extra = entropy_rows.to(mask.device) & ~mask
            with torch.no_grad():
                h = hidden[extra]
                _, _, extra_entropy, _ = op(st, h, rows.weight, rows.bias, targets.new_zeros(h.shape[0]), True, False)
    log_probs, entropy, top1 = (trl_head.scatter(mask, x) for x in (logp, entropy, top1))
    if extra is not None:
        entropy = entropy.masked_scatter(extra, extra_entropy)
    return TokenStats(log_probs, entropy, top1, mask, value)


# ------------------------------------------------------------------------------------- TRL >= 1.15 fused head
def trl_fused_forward(model: nn.Module, st: HeadSettings, op, output_class, *args: Any, **kwargs: Any):
    """TRL's ``fused_lm_head=True`` forward with leantrain's op in place of TRL's kernel."""
    out, hidden, targets, num_items_in_batch = trl_head.backbone_pass(
        model, st.backbone_attr, st.text_config, args, kwargs
    )
    need = dict(need_entropy="entropy" in st.outputs, need_top1="is_top1" in st.outputs)
    if st.trl_loss_type is None:  # per-token log-probs with their own gradient
        stats = score(model, st, op, hidden, targets, **need)
        log_probs = stats.log_probs
        total = -log_probs.sum()
    else:  # the op's scalar loss (3 GEMMs for a trainable head); the log-probs carry its gradient
        stats = score(model, st, op, hidden, targets, loss=lambda m: LossSpec(st.trl_loss_type, _one(m)), **need)
        log_probs, total = carry_loss_gradient(stats, st.trl_loss_type), stats.loss
    mask = stats.label_mask
    loss = total / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
    loss, aux_loss = trl_head.with_aux_loss(model, st, out, kwargs, loss)
    return output_class(
        loss=loss,
        log_probs=log_probs,
        entropy=stats.entropy,
        is_top1=stats.is_top1,
        label_mask=mask,
        aux_loss=aux_loss,
    )


def _one(mask: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=mask.device)


def carry_loss_gradient(stats: TokenStats, loss_type: str) -> torch.Tensor:
    """Log-probs whose values are the op's and whose gradient is the op's scalar loss ``S = Σ_i w_i·(-logp_i)``'s.

    TRL >= 1.15's SFT loss is ``Σ_i -w_i·log_probs_i / D`` (``w_i`` = 1 for nll, ``exp(log_probs_i)`` detached for
    dft, both 0 on ignored positions; ``D`` the token count or num_items_in_batch). With ``log_probs_i = logp_i +
    κ·(S - S.detach())`` (zero in value) and ``κ = -1 / Σ_i w_i``, that loss's gradient is ``dS / D``: the gradient
    of ``S / D``, TRL's loss, computed by the op's scalar path instead of per token. The probe checks that TRL's
    ``compute_loss`` takes the log-probs only through that sum."""
    mask, log_probs = stats.label_mask, stats.log_probs
    weights = mask.float() if loss_type == "nll" else log_probs.exp() * mask
    total = weights.sum()
    kappa = torch.where(total > 0, -1.0 / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return log_probs + (stats.loss - stats.loss.detach()) * kappa * mask


def make_trl_fused_forward(fast: Callable[..., Any], fallback: RuntimeFallback, original: Callable[..., Any]):
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("fused_lm_head", False):
            return original(*args, **kwargs)
        return fallback.call(fast, original, *args, **kwargs)

    return forward


# ------------------------------------------------------------------------------ TRL 1.4 - 1.14 chunked_nll
def chunked_forward(model: nn.Module, st: HeadSettings, op, output_class, **kwargs: Any):
    """TRL's ``_chunked_ce_forward`` (a call with labels) with leantrain's op: the loss, the valid-label count, the
    correct-argmax count and the entropy sum over the labelled positions, as TRL's output class carries them."""
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    router = kwargs.pop("output_router_logits", None)
    if router is None:
        router = getattr(st.text_config, "output_router_logits", False)
    kwargs.pop("use_cache", None)
    if router:
        kwargs["output_router_logits"] = True
    out = model.base_model(use_cache=False, **kwargs)
    hidden = out.last_hidden_state
    if shift_labels is not None:
        targets = shift_labels
    else:
        hidden, targets = hidden[..., :-1, :], labels[..., 1:]

    def loss_spec(mask: torch.Tensor) -> LossSpec:
        normalizer = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return LossSpec("nll", inverse(normalizer, mask.device))

    stats = score(model, st, op, hidden, targets, loss=loss_spec)
    loss, n_valid = stats.loss, stats.label_mask.sum()
    loss, aux_loss = trl_head.with_aux_loss(model, st, out, kwargs, loss)
    return output_class(
        loss=loss,
        logits=None,
        hidden_states=out.hidden_states,
        past_key_values=None,
        attentions=None,
        num_correct_tokens=stats.is_top1.sum().float(),
        entropy_sum=stats.entropy.sum(),
        num_valid_tokens=n_valid,
        aux_loss=aux_loss,
    )


def make_chunked_forward(fast: Callable[..., Any], fallback: RuntimeFallback, original: Callable[..., Any]):
    def forward(*args: Any, **kwargs: Any) -> Any:
        # TRL's chunked forward serves calls with labels; keyword calls only (the trainer's), the rest is stock
        if args or (kwargs.get("labels") is None and kwargs.get("shift_labels") is None):
            return original(*args, **kwargs)
        return fallback.call(fast, original, **kwargs)

    return forward


# ------------------------------------------------------------------------------- full logits: the request
def request_forward(model: nn.Module, parts: ModelParts, op, request: Request, *args: Any, **kwargs: Any):
    """The model's own forward with labels, from the fused op: its loss (``ForCausalLMLoss``: the sum over labelled
    positions / ``num_items_in_batch``, else their mean) plus its MoE aux loss, and the per-position values the
    request asks for."""
    st = parts.settings
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    if request.labels is not None:
        labels = request.labels
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    if kwargs.pop("logits_to_keep", 0) not in (0, None):
        raise ValueError("logits_to_keep on a training call with labels")
    kwargs["use_cache"] = False
    router = False
    if parts.moe:
        router = kwargs.get("output_router_logits")
        router = bool(model.config.output_router_logits if router is None else router)
        kwargs["output_router_logits"] = router
    out = getattr(model, st.backbone_attr)(*args, **kwargs)
    hidden = out.last_hidden_state
    if shift_labels is not None:
        targets = shift_labels
    else:  # position t predicts label t+1; the last position predicts nothing
        targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    entropy_rows = None
    if request.entropy == "attention":
        attention = kwargs.get("attention_mask")
        if attention is not None and attention.dim() == 2:
            entropy_rows = attention.bool()
        else:  # padding-free: every position is a token
            entropy_rows = torch.ones(targets.shape, dtype=torch.bool, device=targets.device)

    def loss_spec(mask: torch.Tensor) -> LossSpec:
        if request.loss == "nll":  # (an all-ignored micro-batch without num_items gives 0 where stock's mean is nan)
            normalizer = mask.sum() if num_items_in_batch is None else num_items_in_batch
        else:
            normalizer = mask.sum() if request.num_items is None else request.num_items
            normalizer = torch.as_tensor(normalizer, device=mask.device).clamp(min=1) if request.clamp else normalizer
        return LossSpec(request.loss, inverse(normalizer, mask.device))

    stats = score(
        model, st, op, hidden, targets, loss=loss_spec, entropy_rows=entropy_rows,
        need_entropy=request.entropy is not None, need_top1=request.top1,
    )  # fmt: skip
    loss = stats.loss
    aux_loss = None
    if router:
        aux_loss = parts.aux_loss(
            out.router_logits, model.num_experts, model.num_experts_per_tok, kwargs.get("attention_mask")
        )
        if request.loss == "nll":  # the model adds it to its own loss; TRL's dft_loss does not
            loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
    return FusedCeOutput(
        loss=loss,
        log_probs=stats.log_probs,
        entropy=stats.entropy,
        is_top1=stats.is_top1,
        label_mask=stats.label_mask,
        aux_loss=aux_loss,
        router_logits=getattr(out, "router_logits", None) if router else None,
        hidden_states=getattr(out, "hidden_states", None),
        attentions=getattr(out, "attentions", None),
    )


def make_request_forward(fast: Callable[..., Any], original: Callable[..., Any]):
    """Calls carrying a request run ``fast`` (its failure reaches the caller's fallback); all others are stock."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        request = kwargs.pop(REQUEST_KEY, None)
        if request is None:
            return original(*args, **kwargs)
        return fast(request, *args, **kwargs)

    return forward


def has_labels(inputs: Any) -> bool:
    """A batch mapping (a dict, or the collator's BatchEncoding) with labels."""
    return isinstance(inputs, Mapping) and (inputs.get("labels") is not None or inputs.get("shift_labels") is not None)


class TrainerLoss:
    """A plain Trainer's glue: ``compute_loss`` asks the model for the fused loss; ``prediction_step`` says whether
    the evaluation loop reads logits (then the stock forward runs)."""

    def __init__(self, fallback: RuntimeFallback) -> None:
        self.fallback = fallback
        self.loss_only = False

    def wrap_compute_loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def fast(model, inputs, *args, **kwargs):
            return original(model, {**inputs, REQUEST_KEY: Request()}, *args, **kwargs)

        def compute_loss(model, inputs, *args, **kwargs):
            return_outputs = kwargs.get("return_outputs", args[0] if args else False)
            if (return_outputs and not self.loss_only) or not has_labels(inputs):
                return original(model, inputs, *args, **kwargs)
            return self.fallback.call(fast, original, model, inputs, *args, **kwargs)

        return compute_loss

    def wrap_prediction_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prediction_step(model, inputs, prediction_loss_only, *args, **kwargs):
            self.loss_only = bool(prediction_loss_only)
            try:
                return original(model, inputs, prediction_loss_only, *args, **kwargs)
            finally:
                self.loss_only = False

        return prediction_step
