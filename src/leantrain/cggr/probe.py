"""CGGR's probe: can the router score this model, which loss path runs, and the plan ``apply`` executes."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from ..fallback import UserInputError
from ..models import DecoderParts, data_parallel_reason, decoder_parts
from ..optimization import PatchContext, Readiness
from .ops import head_share


# Auto mode applies CGGR only where the LM head is at least this share of per-token matmul work. On an H100 the
# no-scoring bound gained nothing on SmolLM2-135M (head ~21%) and 1.08-1.14x on Qwen2.5-0.5B (head ~28%).
AUTO_MIN_HEAD_SHARE = 0.25


@dataclass(frozen=True)
class CggrPlan:
    """What the probe found: the decoder's parts, the router's layer (1-based) and the loss path."""

    parts: DecoderParts
    router_layer: int
    path: str
    kept_only: bool  # leantrain's kept-row loss (logits_to_keep) instead of the stock loss over masked labels


def _triton_device(trainer: Any) -> bool:
    from transformers.utils import is_triton_available

    return trainer.args.device.type in ("cuda", "xpu") and is_triton_available()


def loss_path(trainer: Any, kind: str, parts: DecoderParts) -> tuple[str, bool, bool]:
    """(description, use leantrain's kept-row loss, does the LM-head work shrink with the kept labels)."""
    full_logits = getattr(trainer, "compute_loss_func", None) is not None or trainer.label_smoother is not None
    if kind == "sft":
        if full_logits:
            return "full logits (compute_loss_func or label smoothing): no LM-head saving", False, False
        if _triton_device(trainer):
            return "TRL fused LM head over kept rows", False, True
        device = trainer.args.device.type
        return f"TRL fused LM head, which scores every row on {device}: no LM-head saving", False, False
    if full_logits:
        return "stock loss over masked labels (compute_loss_func or label smoothing): no LM-head saving", False, False
    if "logits_to_keep" not in inspect.signature(parts.model.forward).parameters:
        return "stock loss over masked labels (the model has no logits_to_keep): no LM-head saving", False, False
    older = _row_logits_to_keep_reason()
    if older:
        return f"stock loss over masked labels ({older}): no LM-head saving", False, False
    return "LM head + cross-entropy on kept rows only (logits_to_keep)", True, True


def resolve_router_layer(value: int, num_layers: int) -> int:
    """The decoder layer (1-based) whose output the router scores: ``N >= 1`` is layer N, ``-k`` the k-th from the
    top (``-1`` = the last layer, whose output is the final hidden state before the final norm)."""
    if 1 <= value <= num_layers:
        return value
    if -num_layers <= value <= -1:
        return num_layers + 1 + value
    raise UserInputError(
        f"cggr_router_layers={value} is outside this model's {num_layers} decoder layers: use 1..{num_layers} "
        f"(after decoder layer N) or -{num_layers}..-1 (from the top; -1 = the final hidden state)"
    )


def describe_router(layer: int, num_layers: int) -> str:
    where = "the final hidden state" if layer == num_layers else f"the output of decoder layer {layer}"
    return f"router scores {where} (layer {layer} of {num_layers})"


def _row_logits_to_keep_reason() -> str | None:
    """The kept-rows head passes per-row indices as ``logits_to_keep``; older transformers read only an int or a
    1-D tensor there (detected by feature; the reason names the first tested version that has it)."""
    from transformers import modeling_utils

    if hasattr(modeling_utils, "slice_logits_to_keep"):
        return None
    from .._compat import TRANSFORMERS_ROW_LOGITS_TO_KEEP, installed

    return (
        f"needs transformers >= {TRANSFORMERS_ROW_LOGITS_TO_KEEP} for per-row logits_to_keep; installed "
        f"{installed('transformers')}"
    )


def _sequence_parallel(trainer: Any) -> bool:
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    return pc is not None and bool(getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False))


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    config = ctx.config
    try:
        parts = decoder_parts(trainer.model)
    except ValueError as error:
        return Readiness.no(f"{error}: CGGR needs a decoder-only causal LM")
    if parts.final_norm is None:
        return Readiness.no(f"{type(parts.trunk).__name__}: no final norm found, so the router cannot score")
    try:
        layer = resolve_router_layer(config.cggr_router_layers, parts.num_layers)
    except UserInputError as error:
        if config.sources["cggr_router_layers"] != "default":
            raise
        # the default depth on a shallower model: declined (cggr=True then raises NotReadyError with this reason)
        return Readiness.no(str(error))
    path, kept_only, saves = loss_path(trainer, ctx.trainer_kind, parts)
    share = head_share(parts.model.config)
    # auto (LEANTRAIN_CGGR=auto) applies CGGR only where it cannot make training slower: weighed with the blockers
    slower = expected_slower(path, saves, share)
    if _sequence_parallel(trainer):
        return Readiness.no(
            "sequence/context parallelism splits the labels across ranks: not supported yet"
        ).with_auto_rule(slower)
    replicas = data_parallel_reason(
        trainer,
        "each replica gets part of the batch inside the forward while CGGR's router hook, shared by every "
        "replica, selects the labels of one whole batch",
    )
    if replicas:
        return Readiness.no(replicas).with_auto_rule(slower)
    detail = (
        f"{describe_router(layer, parts.num_layers)}, scoring={config.cggr_scoring}; "
        f"loss path: {path}; LM head ~{share:.0%} of matmul work"
    )
    plan = CggrPlan(parts, layer, path, kept_only)
    return Readiness(detail=detail, plan=plan).with_auto_rule(slower)


def expected_slower(path: str, saves: bool, share: float) -> str | None:
    """Why CGGR would make this run slower (the router's scoring costs, the LM-head work it saves), or None."""
    if not saves:
        return f"the active loss path does not skip masked labels ({path})"
    if share < AUTO_MIN_HEAD_SHARE:
        return (
            f"the LM head is ~{share:.0%} of per-token matmul work (< {AUTO_MIN_HEAD_SHARE:.0%}): masking labels "
            "saves less than scoring costs"
        )
    return None
