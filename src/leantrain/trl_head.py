"""TRL's fused LM head, one adapter for every optimization that serves it (``fused_ce``, ``grpo_logps``).

TRL >= 1.15's ``add_fused_lm_head`` rebinds ``forward`` on the model instance: with ``fused_lm_head=True`` it runs the
backbone, then its own chunked head on the labelled rows, and returns per-token log-probs (and what ``outputs`` asks
for) in ``FusedCausalLMOutput``. This module owns what reading and serving that protocol takes, once:

- finding TRL's forward under the wrappers (bound methods, ``functools.wraps``, accelerate's autocast forward);
- :class:`HeadSettings`, read from that forward's closure, and the checks on it (the scaling, the outputs);
- the backbone half of the forward (:func:`backbone_pass`), the head half on the labelled rows only
  (:func:`head_rows`, :func:`scatter`), the op on its best backend (:func:`run_op`) and the MoE aux loss;
- the TRL source markers, with the versions they were read from.

The optimizations keep their own paths (the SFT loss, GRPO's no-grad rule) and their own op calls."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from .fallback import RuntimeFallback
from .lm_head import ops
from .models import head_weight, logit_transform, zero3_gather


# ------------------------------------------------------------------------------------- TRL source markers
# Read from TRL 1.15 and 1.16 (``trl/trainer/utils.py::add_fused_lm_head``): the names ``_fused_forward`` closes
# over. ``logit_scale``, ``final_logit_softcapping`` and ``backbone_attr`` are read when present (1.15 lacks some).
FUSED_FORWARD = "_fused_forward"
FUSED_CLOSURE = ("original_forward", "temperature", "cast_lm_head_to_fp32", "outputs", "text_config")
# Read from TRL 1.4 - 1.14 (``trl/trainer/sft_trainer.py``): the ``loss_type="chunked_nll"`` forward's closure.
CHUNKED_FORWARD = "_chunked_ce_forward"
CHUNKED_CLOSURE = ("original_forward", "text_config", "logit_scale", "final_logit_softcapping")
# TRL's ignore index for labels (every version)
IGNORE_INDEX = -100
# The attributes through which a wrapper reaches what it wraps: bound methods, functools.wraps, accelerate's
# ``convert_outputs_to_fp32`` / autocast forwards (a prepared reference model)
_WRAPPED_BY = ("__func__", "__wrapped__", "model_forward")


def find_code(obj: Any, name: str) -> Callable[..., Any] | None:
    """The function named ``name`` under the callable ``obj`` (through bound methods and wrappers), or None."""
    for _ in range(12):
        if obj is None:
            return None
        code = getattr(obj, "__code__", None)
        if code is not None and code.co_name == name:
            return obj
        obj = next((getattr(obj, a) for a in _WRAPPED_BY if getattr(obj, a, None) is not None), None)
    return None


def trl_has_fused_head() -> bool:
    """Whether the installed TRL ships ``add_fused_lm_head`` (1.15 and later): then its trainers score through it."""
    try:
        from trl.trainer import utils as trl_utils
    except ImportError:
        return False
    return hasattr(trl_utils, "add_fused_lm_head")


def fused_forward_of(model: nn.Module) -> Callable[..., Any] | None:
    """TRL's ``_fused_forward`` under this instance's own ``forward`` (``add_fused_lm_head`` binds it), or None."""
    return find_code(model.__dict__.get("forward"), FUSED_FORWARD)


def closure(fwd: Callable[..., Any], required: tuple[str, ...]) -> dict[str, Any] | str:
    """The names ``fwd`` closes over, or a reason naming those of ``required`` that are missing."""
    names = inspect.getclosurevars(fwd).nonlocals
    missing = [n for n in required if n not in names]
    if missing:
        return f"TRL's {fwd.__name__} closure changed (missing {', '.join(missing)}): TRL not recognised"
    return names


# ------------------------------------------------------------------------------------------- the settings
@dataclass(frozen=True)
class HeadSettings:
    """What the head computes, ``softcap(logit_scale * h·Wᵀ) / temperature``, and how TRL's fused head runs it."""

    temperature: float = 1.0
    outputs: tuple[str, ...] = ("log_probs", "entropy", "is_top1")  # what TRL asks its fused head for
    cast_lm_head_to_fp32: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None
    backbone_attr: str = "base_model"
    text_config: Any = None
    # fused_ce on TRL >= 1.15: the loss its compute_loss sums from the log-probs ("nll" / "dft"), when recognised
    trl_loss_type: str | None = None


def fused_settings(model: nn.Module) -> HeadSettings | str:
    """TRL's fused-head settings for ``model``, read from its forward's closure; a reason when not recognised."""
    fwd = fused_forward_of(model)
    if fwd is None:
        return f"{type(model).__name__}.forward is not TRL's fused LM head (add_fused_lm_head)"
    names = closure(fwd, FUSED_CLOSURE)
    if isinstance(names, str):
        return names
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


def head_shape(model: nn.Module) -> tuple[torch.Tensor, int, int] | None:
    """(weight, V, H) of the LM head, from its global shape: a ZeRO-3 / FSDP2 head is not gathered to decide."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    return (weight, int(shape[0]), int(shape[1])) if len(shape) == 2 else None


def outputs_reason(settings: HeadSettings, served: tuple[str, ...]) -> str | None:
    """A reason when TRL asks its fused head for outputs the op does not compute (of ``served``)."""
    extra = [o for o in settings.outputs if o not in served]
    return f"TRL asks its fused head for {', '.join(extra)}, which leantrain's op does not compute" if extra else None


def scaling_reason(settings: HeadSettings, config: Any) -> str | None:
    """A reason where TRL's head scaling and the model's disagree: leantrain computes what TRL's head computes, and
    an unknown scaling would change the loss either way."""
    try:
        scale, softcap = logit_transform(config)
    except ValueError as error:
        return f"unknown output scaling: {error}"
    if abs(scale - settings.logit_scale) <= 1e-12 * max(1.0, abs(scale)) and softcap == settings.softcap:
        return None
    return (
        f"unknown output scaling: TRL's head scales the logits by logit_scale={settings.logit_scale}, "
        f"softcap={settings.softcap} but the model by logit_scale={scale}, softcap={softcap}: TRL's head stays"
    )


# ---------------------------------------------------------------------------------- the backbone half
class BackbonePass(NamedTuple):
    """TRL's ``fused_lm_head=True`` call up to the head: what the fused losses and log-probs start from."""

    out: Any  # the backbone's output (``router_logits`` for the MoE aux loss)
    hidden: torch.Tensor  # hidden states aligned with ``targets``
    targets: torch.Tensor  # next-token labels (-100 where ignored)
    num_items_in_batch: Any


def backbone_pass(model: nn.Module, backbone_attr: str, config: Any, args: tuple, kwargs: dict) -> BackbonePass:
    """Run the backbone of TRL's ``fused_lm_head=True`` forward. Pops TRL's head arguments from ``kwargs`` (the
    caller's own dict, which then holds what the backbone received: ``attention_mask``, ``output_router_logits``).
    ``shift_labels`` (padding-free and packed batches) are already aligned; ``labels`` shift by one."""
    kwargs.pop("fused_lm_head", None)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    kwargs["use_cache"] = False
    if getattr(config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    out = getattr(model, backbone_attr)(*args, **kwargs)
    if shift_labels is None:
        return BackbonePass(out, out.last_hidden_state[:, :-1], labels[:, 1:], num_items_in_batch)
    return BackbonePass(out, out.last_hidden_state, shift_labels, num_items_in_batch)


# -------------------------------------------------------------------------------------- the head half
@dataclass
class HeadRows:
    """The head's inputs on the labelled rows: what the op sees (as TRL's head on CUDA: ``hidden[mask]``)."""

    hidden: torch.Tensor  # [B, T, H] on the head's device (fp32 when TRL casts the head)
    targets: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] bool: the labelled positions
    weight: torch.Tensor
    bias: torch.Tensor | None


@contextlib.contextmanager
def head_rows(model: nn.Module, st: HeadSettings, hidden: torch.Tensor, targets: torch.Tensor) -> Iterator[HeadRows]:
    """The head's weight (FSDP2 DTensor gathered once, as TRL does; ZeRO-3 gathered for the block), the hidden states
    and targets on its device, and autocast off when TRL casts the head to fp32."""
    head = model.get_output_embeddings()
    weight = head_weight(head)
    bias = getattr(head, "bias", None)
    if bias is not None and hasattr(bias, "full_tensor"):
        bias = bias.full_tensor()
    hidden = hidden.to(weight.device)
    targets = targets.to(weight.device)
    mask = targets != IGNORE_INDEX
    autocast = contextlib.nullcontext()
    if st.cast_lm_head_to_fp32:
        hidden = hidden.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    with autocast, zero3_gather(weight, bias):
        yield HeadRows(hidden, targets, mask, weight, bias)


def scatter(mask: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
    """Per-row values back to ``mask``'s shape, zero (False) elsewhere. ``masked_scatter`` keeps an all-masked
    micro-batch connected to the graph (a differentiable zero), like TRL."""
    return None if values is None else values.new_zeros(mask.shape).masked_scatter(mask, values)


def head_options(st: HeadSettings, weight: torch.Tensor, bias: torch.Tensor | None = None) -> dict[str, Any]:
    """The op's keyword arguments for the head's transform, and the ZeRO-3 context its backward re-enters."""
    return dict(
        temperature=st.temperature,
        logit_scale=st.logit_scale,
        softcap=st.softcap,
        weight_context=functools.partial(zero3_gather, weight, bias) if hasattr(weight, "ds_id") else None,
    )


T = TypeVar("T")


def kernel_guard(name: str, fallback: RuntimeFallback) -> RuntimeFallback:
    """The guard around the Triton kernel: its failure warns once, then the op's torch path serves; the failure
    reaches the report through the optimization's own fallback (``on_failure``)."""
    report = fallback.on_failure

    def on_failure(reason: str) -> None:
        if report is not None:
            report(f"the Triton kernel failed ({reason}); leantrain's torch path serves")

    return RuntimeFallback(f"{name} triton kernel", fallback.strict, on_failure)


def run_op(guard: RuntimeFallback, device: torch.device, run: Callable[[str], T]) -> T:
    """``run(backend)`` on the best backend for ``device``; a Triton failure falls back to the torch path (once)."""
    if ops.default_backend(device) != "triton":
        return run("torch")
    # Triton launches on the current device: make it the tensors' one (models placed on cuda:1, device maps)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return guard.call(run, lambda _backend: run("torch"), "triton")


# ------------------------------------------------------------------------------------------- MoE aux loss
def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def aux_terms(model: nn.Module, text_config: Any) -> tuple[int, int, float]:
    """(experts, experts per token, coefficient) as TRL's fused and chunked heads read them: the counts from the
    model on transformers 4, from the text config on 5 (gpt-oss configs before transformers 5.6 lack
    ``num_experts``: the model's count, else the config's ``num_local_experts``); the coefficient from the text
    config (0 where it has none)."""
    coef = getattr(text_config, "router_aux_loss_coef", 0.0)
    if _transformers_major() < 5:
        return model.num_experts, model.num_experts_per_tok, coef
    experts = (
        getattr(text_config, "num_experts", None)
        or getattr(model, "num_experts", None)
        or text_config.num_local_experts
    )
    return experts, text_config.num_experts_per_tok, coef


def aux_loss(model: nn.Module, text_config: Any, router_logits: Any, attention_mask: Any) -> torch.Tensor:
    """The MoE load-balancing loss TRL's fused head adds: Mixtral's, the one every MoE family pulls in through the
    modular system (as TRL does)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts, top_k, _ = aux_terms(model, text_config)
    return load_balancing_loss_func(router_logits, experts, top_k, attention_mask)


def with_aux_loss(
    model: nn.Module, st: HeadSettings, out: Any, kwargs: dict, loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss plus the weighted aux loss, the aux loss) where the backbone was asked for router logits (``kwargs``:
    what it received); else (loss, None)."""
    if not kwargs.get("output_router_logits"):
        return loss, None
    aux = aux_loss(model, st.text_config, out.router_logits, kwargs.get("attention_mask"))
    return loss + aux_terms(model, st.text_config)[2] * aux.to(loss.device), aux
