"""How leantrain hooks TRL's log-prob scoring.

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
import inspect
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..fallback import RuntimeFallback
from ..lm_head import ops
from ..models import head_weight, head_weight_reasons, logit_transform, zero3_gather
from . import nograd


FUSED_OUTPUTS = ("log_probs", "entropy")
_TRL_CLOSURE = ("original_forward", "temperature", "cast_lm_head_to_fp32", "outputs", "text_config")


@dataclass
class HeadSettings:
    """What TRL's fused head computes for one model (read from its closure, or set by us for old TRL)."""

    temperature: float
    outputs: tuple[str, ...]
    cast_lm_head_to_fp32: bool
    logit_scale: float
    softcap: float | None
    backbone_attr: str
    text_config: Any


def trl_fused_forward(model: nn.Module) -> Callable[..., Any] | None:
    """TRL's ``_fused_forward`` function under this instance's ``forward`` (possibly inside accelerate's autocast /
    fp32-output wrappers, as on a prepared reference model), or None."""
    return _find_fused(model.__dict__.get("forward"))


def _find_fused(obj: Any) -> Callable[..., Any] | None:
    """TRL's ``_fused_forward`` under the callable ``obj`` (through bound methods and wrappers), or None."""
    for _ in range(12):
        if obj is None:
            return None
        code = getattr(obj, "__code__", None)
        if code is not None and code.co_name == "_fused_forward":
            return obj
        obj = next(
            (
                getattr(obj, a)
                for a in ("__func__", "__wrapped__", "model_forward")
                if getattr(obj, a, None) is not None
            ),
            None,
        )
    return None


def trl_head_settings(model: nn.Module) -> HeadSettings | str:
    """Read TRL's fused-head settings from its forward closure; a reason string when not recognised."""
    fwd = trl_fused_forward(model)
    if fwd is None:
        return f"{type(model).__name__}.forward is not TRL's fused LM head (add_fused_lm_head)"
    names = inspect.getclosurevars(fwd).nonlocals
    missing = [n for n in _TRL_CLOSURE if n not in names]
    if missing:
        return f"TRL's fused forward closure changed (missing {', '.join(missing)}): TRL version not recognised"
    scale = names.get("logit_scale", 1.0)
    softcap = names.get("final_logit_softcapping")
    return HeadSettings(
        temperature=float(names["temperature"]),
        outputs=tuple(names["outputs"]),
        cast_lm_head_to_fp32=bool(names["cast_lm_head_to_fp32"]),
        logit_scale=float(1.0 if scale is None else scale),
        softcap=float(softcap) if softcap else None,
        backbone_attr=names.get("backbone_attr", "base_model"),
        text_config=names["text_config"],
    )


def scaling_reason(settings: HeadSettings, config: Any) -> str | None:
    """Decline when TRL's scaling and leantrain's model adapter disagree (unknown output scaling)."""
    try:
        scale, softcap = logit_transform(config)
    except ValueError as error:
        return f"unknown output scaling: {error}"
    if not (abs(scale - settings.logit_scale) <= 1e-12 * max(1.0, abs(scale)) and softcap == settings.softcap):
        return (
            f"unknown output scaling: TRL uses logit_scale={settings.logit_scale}, softcap={settings.softcap}, "
            f"leantrain reads logit_scale={scale}, softcap={softcap}; leaving TRL's head in place"
        )
    return None


def head_reasons(model: nn.Module) -> list[str]:
    head = model.get_output_embeddings()
    reasons = []
    if head is None:
        return [f"{type(model).__name__} has no output embeddings (LM head)"]
    if getattr(head, "bias", None) is not None:
        reasons.append("the LM head has a bias: leantrain's fused op has no bias term; TRL's head runs")
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        reasons.append("the LM head carries a PEFT adapter: remove 'lm_head' from target_modules")
        return reasons
    return reasons + [f"{r}: TRL's head runs" for r in head_weight_reasons(getattr(head, "weight", None))]


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


def head_shape(model: nn.Module) -> tuple[torch.Tensor, int, int] | None:
    """(weight, V, H) of the LM head, from its global shape: a ZeRO-3 / FSDP2 head is not gathered to decide."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    return (weight, *shape) if len(shape) == 2 else None


def uses_trl_head(model: nn.Module, call: FusedCall) -> bool:
    """Whether this ``fused_lm_head=True`` call goes to TRL's own fused forward instead of the op: no gradient
    wanted, TRL's fused head underneath, and the no-grad rule says so for this head."""
    if torch.is_grad_enabled() or not call.trl_head:
        return False
    found = head_shape(model)
    return found is not None and nograd.trl_head_serves(found[1], ops.default_backend(found[0].device))


def nograd_detail(heads: list[tuple[str, nn.Module]]) -> str:
    """The report's words for the no-grad dispatch: which (label, model) heads' no-grad calls use TRL's own head."""
    parts = []
    for label, model in heads:
        found = head_shape(model)
        if found is None or not nograd.trl_head_serves(found[1], ops.default_backend(found[0].device)):
            continue
        _, v, h = found
        parts.append(f"{'policy' if label == 'model' else label.replace('_', ' ')} H={h} V={v} (any N)")
    if not parts:
        return ""
    return f"no-grad calls at {', '.join(parts)} use TRL's own head (measured faster: {nograd.SOURCE})"


def fused_forward(model: nn.Module, call: FusedCall, *args: Any, **kwargs: Any):
    """TRL's ``fused_lm_head=True`` forward with leantrain's op in place of ``ChunkedLogProbFunction``."""
    st = call.settings
    kwargs.pop("fused_lm_head", None)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    kwargs["use_cache"] = False
    if getattr(st.text_config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    backbone_out = getattr(model, st.backbone_attr)(*args, **kwargs)
    if shift_labels is None:
        hidden = backbone_out.last_hidden_state[:, :-1]
        labels = labels[:, 1:]
    else:
        hidden = backbone_out.last_hidden_state
        labels = shift_labels
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise RuntimeError("LM head has a bias")  # the probe declines these; reaching here means the model changed
    weight = head_weight(head)  # FSDP2 DTensor: gathered once, as TRL does
    hidden = hidden.to(weight.device)
    labels = labels.to(weight.device)
    mask = labels != -100
    autocast = nullcontext()
    if st.cast_lm_head_to_fp32:
        hidden = hidden.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    need_entropy = "entropy" in st.outputs
    entropy_grad = need_entropy and call.entropy_grad()
    with autocast, zero3_gather(weight):
        logp, entropy = call.run_op(st, hidden[mask], weight, labels[mask], need_entropy, entropy_grad)
    # masked_scatter keeps an all-masked micro-batch connected to the graph (a differentiable zero), like TRL
    log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
    entropy = None if entropy is None else entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
    denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / denom
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _aux_loss(st.text_config, backbone_out, kwargs.get("attention_mask"))
        loss = loss + getattr(st.text_config, "router_aux_loss_coef", 0.0) * aux_loss
    output = _output_class()
    return output(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)


def _aux_loss(text_config: Any, backbone_out: Any, attention_mask: torch.Tensor | None) -> torch.Tensor:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    num_experts = getattr(text_config, "num_experts", None) or text_config.num_local_experts
    return load_balancing_loss_func(
        backbone_out.router_logits, num_experts, text_config.num_experts_per_tok, attention_mask
    )


# ----------------------------------------------------------------------------------------------- TRL <= 1.14
_TEXT_ONLY = ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy")


def legacy_method_name(trainer: Any) -> str:
    """The full-logits method to replace: GRPO 1.14 dispatches ``_get_per_token_logps_and_entropies`` (a
    ``*args`` wrapper) to ``_full_logits_logps``; earlier TRL and RLOO compute in the method itself."""
    return "_full_logits_logps" if hasattr(trainer, "_full_logits_logps") else "_get_per_token_logps_and_entropies"


def legacy_method_kind(trainer: Any) -> int | str:
    """2 or 3 (values returned by the old full-logits method), or a reason string."""
    name = legacy_method_name(trainer)
    method = getattr(trainer, name, None)
    if method is None:
        return "the trainer has neither TRL's fused LM head nor _get_per_token_logps_and_entropies: TRL not recognised"
    params = inspect.signature(method).parameters
    if not all(n in params for n in _TEXT_ONLY[1:]):
        return f"{name} has an unknown signature: TRL version not recognised"
    return 3 if "compute_aux_loss" in params else 2


def legacy_reason(trainer: Any) -> str | None:
    """Why the TRL <= 1.14 path cannot serve this trainer, or None."""
    if getattr(trainer, "use_liger_kernel", False):
        return (
            "use_liger_kernel=True: this TRL computes the GRPO loss (and in 1.14 the log-probs) with Liger's own "
            "fused kernel, not the full-logits method leantrain replaces; set use_liger_kernel=False or upgrade "
            "to trl >= 1.15"
        )
    return None


def legacy_settings(trainer: Any, base: nn.Module) -> HeadSettings:
    text = base.config.get_text_config()
    scale, softcap = logit_transform(base.config)
    return HeadSettings(
        temperature=float(trainer.temperature),
        outputs=FUSED_OUTPUTS,
        cast_lm_head_to_fp32=bool(getattr(getattr(trainer, "args", None), "cast_lm_head_to_fp32", False)),
        logit_scale=scale,
        softcap=softcap,
        backbone_attr="base_model",
        text_config=text,
    )


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


# ------------------------------------------------------------------ the wrappers apply() installs
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
            temperature=st.temperature,
            logit_scale=st.logit_scale,
            softcap=st.softcap,
            need_entropy=need_entropy,
            entropy_grad=entropy_grad,
            tile_mib=tile_mib,
            backend=backend,
            keep_logits_mib=keep_logits_mib,
            weight_context=functools.partial(zero3_gather, weight) if hasattr(weight, "ds_id") else None,
        )

    if ops.default_backend(hidden.device) == "triton":
        # Triton launches on the current device: make it the tensors' one (models placed on cuda:1, device maps)
        with torch.cuda.device(hidden.device) if hidden.is_cuda else nullcontext():
            return guard.call(run, lambda _backend: run("torch"), "triton")
    return run("torch")
