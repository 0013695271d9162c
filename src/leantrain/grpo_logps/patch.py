"""How leantrain hooks TRL's log-prob scoring.

TRL >= 1.15: ``add_fused_lm_head`` rebinds ``forward`` on the (PEFT base) model instance; with ``fused_lm_head=True``
it runs the backbone and ``ChunkedLogProbFunction``. We wrap that same instance attribute: fused calls run the
backbone exactly as TRL does and then leantrain's op, returning TRL's ``FusedCausalLMOutput``; all other calls (and
every call after a run-time failure) go to TRL's forward. The trainer keeps calling the accelerator-wrapped module, so
DDP/FSDP gradient sync is untouched.

TRL <= 1.14 (a full-logits method returning 2 or 3 values: ``_get_per_token_logps_and_entropies`` in 0.2x-1.13 and
in RLOO, ``_full_logits_logps`` behind it in GRPO 1.14): we install the same ``fused_lm_head`` forward protocol on the
base model ourselves and replace that method (text-only calls; any other call goes to the original) with one that
calls the wrapped model with ``fused_lm_head=True``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ..fallback import RuntimeFallback
from ..lm_head import ops
from ..models import head_weight, head_weight_reasons, logit_transform, zero3_gather


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
    """Everything the fused forward needs besides the model: settings and the op runner."""

    settings: HeadSettings
    # run_op(settings, hidden, weight, targets, need_entropy, entropy_grad) -> (logp, entropy)
    run_op: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    entropy_grad: Callable[[], bool]


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


# ------------------------------------------------------------------------------ no-grad dispatch (issue #28)
# Median-to-median differences below this share are timing noise on the H100 (the probe's p20-p80 spread: 1-3%).
NOGRAD_NOISE = 0.03


class NogradPoint(NamedTuple):
    """One measured no-grad call: TRL's own fused head (stock) vs leantrain's op, median CUDA ms."""

    n: int  # scored rows (TRL scores only the labelled positions on CUDA)
    h: int
    v: int
    dtype: str  # the logits tiles' dtype, torch's name without "torch."
    entropy: bool  # the head also computes the entropy (TRL's policy head: yes; its reference-model head: no)
    stock_ms: float
    fused_ms: float

    @property
    def stock_wins(self) -> bool:
        # leantrain's op keeps a cell only when it measured faster beyond the timing noise: a tie goes to the stock
        # head it would replace (no default slower than stock), and a verdict that flips inside the noise would make
        # the rule depend on N, which costs a host sync to count the scored rows.
        return self.fused_ms > self.stock_ms * (1 - NOGRAD_NOISE)


# Where leantrain's no-grad forward (old / reference log-probs) measured slower than the TRL head it replaces, the
# wrapped forward calls TRL's own (so does a tie within NOGRAD_NOISE). Source: benchmarks/results/
# grpo_logps_nograd.{json,md} (probe_logps_nograd.py: TRL 1.16's ChunkedLogProbFunction as its fused head calls it
# vs leantrain's Triton op, bf16, with and without entropy, 6 GRPO shapes x N 1024..16384), NVIDIA H100 80GB HBM3,
# 2026-11-25. TRL's head was faster in 58 of 60 cells (by up to 15%; the 2 others within 3%), so no-grad calls of
# these shapes take TRL's head. Regenerate after a GPU run: `python benchmarks/probe_logps_nograd.py --emit-rule`
# prints both constants from grpo_logps_nograd.json.
NOGRAD_SOURCE = "NVIDIA H100 80GB HBM3, 2026-11-25, grpo_logps_nograd.json at 0a6f1e8"
NOGRAD_MEASURED: tuple[NogradPoint, ...] = (
    NogradPoint(1024, 4096, 128256, "bfloat16", True, 1.992, 2.0633),
    NogradPoint(2048, 4096, 128256, "bfloat16", True, 3.6819, 3.8825),
    NogradPoint(4096, 4096, 128256, "bfloat16", True, 7.7142, 7.5122),
    NogradPoint(8192, 4096, 128256, "bfloat16", True, 14.7178, 15.3575),
    NogradPoint(16384, 4096, 128256, "bfloat16", True, 29.2401, 29.626),
    NogradPoint(1024, 4096, 128256, "bfloat16", False, 1.9508, 2.0463),
    NogradPoint(2048, 4096, 128256, "bfloat16", False, 3.5913, 3.8399),
    NogradPoint(4096, 4096, 128256, "bfloat16", False, 7.5375, 7.6309),
    NogradPoint(8192, 4096, 128256, "bfloat16", False, 14.1053, 14.9854),
    NogradPoint(16384, 4096, 128256, "bfloat16", False, 27.8865, 28.2829),
    NogradPoint(1024, 896, 151936, "bfloat16", True, 0.8286, 0.9102),
    NogradPoint(2048, 896, 151936, "bfloat16", True, 1.3316, 1.4841),
    NogradPoint(4096, 896, 151936, "bfloat16", True, 2.4521, 2.6368),
    NogradPoint(8192, 896, 151936, "bfloat16", True, 5.0091, 5.2139),
    NogradPoint(16384, 896, 151936, "bfloat16", True, 10.2758, 10.4925),
    NogradPoint(1024, 896, 151936, "bfloat16", False, 1.6187, 1.6333),
    NogradPoint(2048, 896, 151936, "bfloat16", False, 1.2843, 1.4806),
    NogradPoint(4096, 896, 151936, "bfloat16", False, 2.2982, 2.6533),
    NogradPoint(8192, 896, 151936, "bfloat16", False, 4.8076, 5.4554),
    NogradPoint(16384, 896, 151936, "bfloat16", False, 9.882, 10.7911),
    NogradPoint(1024, 1536, 151936, "bfloat16", True, 1.0874, 1.1763),
    NogradPoint(2048, 1536, 151936, "bfloat16", True, 1.9048, 2.0435),
    NogradPoint(4096, 1536, 151936, "bfloat16", True, 3.6241, 3.9062),
    NogradPoint(8192, 1536, 151936, "bfloat16", True, 7.6775, 7.808),
    NogradPoint(16384, 1536, 151936, "bfloat16", True, 15.0493, 15.5083),
    NogradPoint(1024, 1536, 151936, "bfloat16", False, 1.0399, 1.1609),
    NogradPoint(2048, 1536, 151936, "bfloat16", False, 1.8184, 2.0146),
    NogradPoint(4096, 1536, 151936, "bfloat16", False, 3.5101, 3.7601),
    NogradPoint(8192, 1536, 151936, "bfloat16", False, 7.4341, 7.616),
    NogradPoint(16384, 1536, 151936, "bfloat16", False, 14.5815, 15.396),
    NogradPoint(1024, 2048, 151936, "bfloat16", True, 1.262, 1.3908),
    NogradPoint(2048, 2048, 151936, "bfloat16", True, 2.3403, 2.4559),
    NogradPoint(4096, 2048, 151936, "bfloat16", True, 4.7035, 4.7468),
    NogradPoint(8192, 2048, 151936, "bfloat16", True, 9.5909, 9.66),
    NogradPoint(16384, 2048, 151936, "bfloat16", True, 18.8648, 19.2099),
    NogradPoint(1024, 2048, 151936, "bfloat16", False, 1.2144, 1.341),
    NogradPoint(2048, 2048, 151936, "bfloat16", False, 2.2512, 2.4388),
    NogradPoint(4096, 2048, 151936, "bfloat16", False, 4.7382, 4.9889),
    NogradPoint(8192, 2048, 151936, "bfloat16", False, 9.1902, 9.7708),
    NogradPoint(16384, 2048, 151936, "bfloat16", False, 18.3023, 19.1491),
    NogradPoint(1024, 3584, 152064, "bfloat16", True, 1.8442, 1.9898),
    NogradPoint(2048, 3584, 152064, "bfloat16", True, 3.796, 3.8979),
    NogradPoint(4096, 3584, 152064, "bfloat16", True, 7.3489, 8.0591),
    NogradPoint(8192, 3584, 152064, "bfloat16", True, 15.5588, 15.6242),
    NogradPoint(16384, 3584, 152064, "bfloat16", True, 30.4507, 31.4309),
    NogradPoint(1024, 3584, 152064, "bfloat16", False, 1.8463, 2.0893),
    NogradPoint(2048, 3584, 152064, "bfloat16", False, 3.8421, 4.0063),
    NogradPoint(4096, 3584, 152064, "bfloat16", False, 7.444, 7.7724),
    NogradPoint(8192, 3584, 152064, "bfloat16", False, 15.0316, 15.5814),
    NogradPoint(16384, 3584, 152064, "bfloat16", False, 29.9086, 30.9223),
    NogradPoint(1024, 5120, 152064, "bfloat16", True, 2.5714, 2.6534),
    NogradPoint(2048, 5120, 152064, "bfloat16", True, 5.2811, 5.39),
    NogradPoint(4096, 5120, 152064, "bfloat16", True, 9.8512, 10.7648),
    NogradPoint(8192, 5120, 152064, "bfloat16", True, 20.352, 21.1092),
    NogradPoint(16384, 5120, 152064, "bfloat16", True, 40.2772, 41.8725),
    NogradPoint(1024, 5120, 152064, "bfloat16", False, 2.6665, 2.7217),
    NogradPoint(2048, 5120, 152064, "bfloat16", False, 5.6291, 5.5481),
    NogradPoint(4096, 5120, 152064, "bfloat16", False, 10.265, 10.2802),
    NogradPoint(8192, 5120, 152064, "bfloat16", False, 20.2255, 20.7725),
    NogradPoint(16384, 5120, 152064, "bfloat16", False, 40.4008, 41.1684),
)
# The rule covers vocabularies within this factor of the measured ones (it extrapolates to the nearest measured
# cell); nothing was measured beyond (e.g. the tiny test models): leantrain's op runs there.
NOGRAD_V_REACH = 2.0


def nograd_prefers_stock(
    n: int | Callable[[], int],
    h: int,
    v: int,
    dtype: torch.dtype | str,
    entropy: bool,
    backend: str = "triton",
    table: tuple[NogradPoint, ...] | None = None,
) -> bool:
    """Whether TRL's own head measured faster than leantrain's op for a no-grad call scoring ``n`` rows of width
    ``h`` against ``v`` logits in ``dtype`` tiles, with the entropy or not, on ``backend`` (only "triton" was
    measured: False elsewhere).

    The verdict of the nearest measured point: same entropy flag and tile dtype size when measured, then the nearest
    hidden size and vocabulary (log scale), then the nearest N there (log scale). ``n`` may be a callable counting
    the rows: it is called only when that cell's verdict depends on N (counting labels syncs the host)."""
    if backend != "triton":
        return False
    profile = _nograd_profile(h, v, _dtype_name(dtype), bool(entropy), NOGRAD_MEASURED if table is None else table)
    verdicts = {stock for _, stock in profile}
    if len(verdicts) <= 1:
        return bool(verdicts) and verdicts.pop()
    log_n = math.log(max(1, n() if callable(n) else n))
    return min(profile, key=lambda point: abs(math.log(point[0]) - log_n))[1]


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(name: str) -> int:
    dtype = getattr(torch, name, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0  # never raises in a forward


@functools.lru_cache(maxsize=64)
def _nograd_profile(
    h: int, v: int, dtype: str, entropy: bool, table: tuple[NogradPoint, ...]
) -> tuple[tuple[int, bool], ...]:
    """(N, stock wins) of the nearest measured (H, V, dtype, entropy) cell, by N; empty out of the rule's reach."""
    if not table or not min(p.v for p in table) / NOGRAD_V_REACH <= v <= max(p.v for p in table) * NOGRAD_V_REACH:
        return ()
    size = _itemsize(dtype)

    def distance(p: NogradPoint) -> tuple:
        mismatch = (p.entropy != entropy, _itemsize(p.dtype) != size, p.dtype != dtype)
        return (*mismatch, abs(math.log(p.h / h)), abs(math.log(p.v / v)))

    best = min(table, key=distance)
    cell = {p.n: p.stock_wins for p in table if (p.h, p.v, p.dtype, p.entropy) == best[1:5]}
    return tuple(sorted(cell.items()))


def nograd_route(
    n: int | Callable[[], int], h: int, v: int, dtype: torch.dtype | str, entropy: bool, backend: str
) -> bool:
    """The decision the trainer's wrapped forward and bench_grpo_logps's ``leantrain_default`` share: TRL's own head
    for a call that needs no gradient (``torch.no_grad()`` / inference mode) where it measured faster."""
    return not torch.is_grad_enabled() and nograd_prefers_stock(n, h, v, dtype, entropy, backend)


def _head_shape(model: nn.Module) -> tuple[torch.Tensor, int, int] | None:
    """(weight, V, H) of the LM head, from its global shape: a ZeRO-3 / FSDP2 head is not gathered to decide."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    return (weight, *shape) if len(shape) == 2 else None


def nograd_uses_stock(original: Callable[..., Any], model: nn.Module, st: HeadSettings, kwargs: dict) -> bool:
    """Whether this ``fused_lm_head=True`` call goes to ``original`` (TRL's own fused forward) instead of the op:
    no gradient wanted and the measured rule says TRL's head is faster there. Never on TRL <= 1.14, whose stock
    method is full logits (the rule compares with TRL's fused head)."""
    if torch.is_grad_enabled() or _find_fused(original) is None:
        return False
    found = _head_shape(model)
    if found is None:
        return False
    weight, v, h = found
    device = weight.device.type
    if st.cast_lm_head_to_fp32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = weight.dtype  # the backbone's output dtype, as a rule

    def rows() -> int:
        labels = kwargs.get("shift_labels")
        if labels is None:
            labels = kwargs.get("labels")
            labels = labels[:, 1:] if labels is not None else None
        return 0 if labels is None else int((labels != -100).sum())

    return nograd_route(rows, h, v, dtype, "entropy" in st.outputs, ops.default_backend(weight.device))


def nograd_detail(heads: list[tuple[str, nn.Module]], args: Any = None) -> str:
    """The report's words for the dispatch: which patched (label, model) heads' no-grad calls use TRL's own head
    (``args``: the trainer's, for its autocast dtype)."""
    autocast = (
        torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
    )
    parts = []
    for label, model in heads:
        found, st = _head_shape(model), trl_head_settings(model)
        if found is None or isinstance(st, str) or ops.default_backend(found[0].device) != "triton":
            continue
        weight, v, h = found
        dtype = torch.float32 if st.cast_lm_head_to_fp32 else autocast
        entropy = "entropy" in st.outputs
        profile = _nograd_profile(h, v, _dtype_name(dtype or weight.dtype), entropy, NOGRAD_MEASURED)
        stock = [n for n, wins in profile if wins]
        if stock:
            at = "any N" if len(stock) == len(profile) else "N near " + "/".join(map(str, stock))
            parts.append(f"{'policy' if label == 'model' else label.replace('_', ' ')} H={h} V={v} ({at})")
    if not parts:
        return ""
    return f"no-grad calls at {', '.join(parts)} use TRL's own head (measured faster: {NOGRAD_SOURCE})"


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
        # >>> issue #28: no-grad calls where TRL's own head measured faster go to it (nograd_uses_stock)
        if nograd_uses_stock(original, model, call.settings, kwargs):
            return original(*args, **kwargs)
        # <<< issue #28
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
