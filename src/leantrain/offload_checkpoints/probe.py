"""The offloaded checkpoints' probe: does the run checkpoint transformers' decoder layers (the trainer's own switch)
on a device this serves; how many host bytes may it hold; and does auto mode apply it (not before its step cost is
measured). The plan names the layers, the host budget and the bytes a token of each checkpointed input takes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models import data_parallel_reason, decoder_parts, text_config, tokens_per_micro_batch, unwrap_model
from ..optimization import PatchContext, Readiness
from ..report import size_text
from . import measured
from .ops import host_budget_bytes, spread_layers


DEVICES = ("cuda", "cpu")
# A copy smaller than this costs more (launch, event, pinned block) than the device memory it frees. Tiny test
# models set it to 0.
MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class OffloadPlan:
    layers: tuple[tuple[str, nn.Module], ...]  # qualified name, decoder layer instance
    trunk: nn.Module  # the decoder stack that calls them (its forward pre-hook re-wraps their checkpoint functions)
    device: str  # the trainer's device type
    budget_bytes: int  # host bytes one process may hold at once
    budget_source: str  # how the budget was set (the option, or half of the available host memory)
    bytes_per_token: int  # one checkpointed input, a token (hidden size x element size)
    tokens_per_micro_batch: int | None  # batch x the longest sequence the trainer is told of, if told
    min_bytes: int
    min_tokens: int = 0  # auto mode: micro-batches of fewer tokens keep stock checkpointing (measured.AUTO_MIN_TOKENS)
    embedding: nn.Module | None = None  # the input embedding (its output, a hook-made leaf, goes on without its grad)
    total_layers: int = 0  # the stack's decoder layers (``layers``: some of them with offload_checkpoints_layers)


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    cfg = ctx.config.config
    model = unwrap_model(trainer.model)
    try:
        parts = decoder_parts(model)
        layers = list(parts.layers)
    except ValueError as error:
        return Readiness.not_applicable(f"{error}: offload_checkpoints moves the decoder layers' checkpointed inputs")
    if not layers or not hasattr(layers[0], "gradient_checkpointing"):
        return Readiness.not_applicable(
            f"{type(layers[0]).__name__ if layers else 'the model'} is not a transformers GradientCheckpointingLayer: "
            "no checkpointed layer inputs to offload"
        )
    device = trainer.args.device.type
    tokens = tokens_per_micro_batch(trainer)
    rule = auto_reason(device, tokens, local_processes())
    reasons = run_reasons(trainer, model, layers, device)
    budget, source = budget_for(cfg.offload_checkpoints_max_host_gib, trainer)
    per_token = bytes_per_token(model)
    asked = cfg.offload_checkpoints_layers
    if asked > len(layers):
        reasons.append(
            f"offload_checkpoints_layers={asked} but the model has {len(layers)} decoder layers: give at most "
            f"{len(layers)}, or 0 for every layer"
        )
    if not reasons and budget < per_token:
        reasons.append(
            f"the host budget ({size_text(budget)}, {source}) holds less than one token of a layer input "
            f"({size_text(per_token)}): free host memory or raise offload_checkpoints_max_host_gib"
        )
    if reasons:
        return Readiness.no(*reasons).with_auto_rule(rule)
    prefix = getattr(model, "base_model_prefix", "model")
    trunk = next((n for n, m in model.named_modules() if m is parts.layers), f"{prefix}.layers")
    plan = OffloadPlan(
        layers=tuple((f"{trunk}.{i}", layers[i]) for i in spread_layers(len(layers), asked)),
        trunk=parts.trunk,
        device=device,
        budget_bytes=budget,
        budget_source=source,
        bytes_per_token=per_token,
        tokens_per_micro_batch=tokens,
        min_bytes=MIN_BYTES if device == "cuda" else 0,
        min_tokens=measured.AUTO_MIN_TOKENS if cfg.offload_checkpoints is None else 0,
        embedding=model.get_input_embeddings(),
        total_layers=len(layers),
    )
    return Readiness(detail=describe(plan), plan=plan).with_auto_rule(rule)


def auto_reason(device: str, tokens: int | None = None, processes: int = 1) -> str | None:
    """Auto mode's rule: on CUDA for micro-batches of at least ``measured.AUTO_MIN_TOKENS`` tokens, the size from
    which every measured case cost at most 3% of the step (shorter ones keep stock checkpointing at run time), one
    process on the host; an option where the trainer's longest micro-batch (``tokens``, if told) is shorter or where
    ``processes`` share the host. None where it applies."""
    if device != "cuda":
        return f"not measured on {device} (the layer inputs are in host memory already: nothing to move off)"
    if processes > 1:
        return (
            f"not measured with {processes} processes on the host, whose copies would share its memory (measured "
            "with one GPU a host), so it is an option here: it frees the checkpointed layer inputs' GPU memory"
        )
    if not measured.within_from(measured.AUTO_MIN_TOKENS):
        return (
            f"its step cost was not within {measured.MAX_COST:.0%} of the step on every measured case "
            f"({measured.EVIDENCE}), so it is an option here: it frees the checkpointed layer inputs' GPU memory"
        )
    if tokens is not None and tokens < measured.AUTO_MIN_TOKENS:
        return (
            f"the trainer's micro-batches hold at most {tokens} tokens (batch x max_length) and its step cost was "
            f"within {measured.MAX_COST:.0%} only from {measured.AUTO_MIN_TOKENS} tokens a micro-batch "
            f"({measured.EVIDENCE}), so it is an option here: it frees the checkpointed layer inputs' GPU memory"
        )
    return None


def checkpointing_on(trainer: Any, layers: list[nn.Module]) -> bool:
    """The trainer's own switch (``gradient_checkpointing`` / ``activation_checkpointing``), or layers a user's
    ``model.gradient_checkpointing_enable()`` already switched on."""
    args = trainer.args
    switch = bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
    return switch or any(getattr(layer, "gradient_checkpointing", False) for layer in layers)


def checkpoint_kwargs(trainer: Any) -> dict[str, Any]:
    args = trainer.args
    return dict(
        getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )  # fmt: skip


def run_reasons(trainer: Any, model: nn.Module, layers: list[nn.Module], device: str) -> list[str]:
    """What stops the offload from serving this run (each a sentence naming the next step)."""
    reasons = []
    if not checkpointing_on(trainer, layers):
        reasons.append(
            "activation checkpointing is off (gradient_checkpointing=False): no checkpointed layer inputs to offload; "
            "turn it on in the trainer's arguments to use offload_checkpoints"
        )
    if checkpoint_kwargs(trainer).get("offload"):
        reasons.append(
            "transformers' own offload is on (activation_checkpointing_kwargs offload=True: the copies run on the "
            "compute stream); drop it to use leantrain's copies on a side stream, or pass offload_checkpoints=False"
        )
    fsdp = getattr(trainer.args, "fsdp_config", None) or {}
    if fsdp.get("activation_checkpointing"):
        reasons.append(
            "FSDP's activation checkpointing (fsdp_config activation_checkpointing) wraps the layers itself; "
            "offload_checkpoints serves transformers' checkpointing (gradient_checkpointing=True instead)"
        )
    if device not in DEVICES:
        reasons.append(f"the trainer runs on {device}: offload_checkpoints copies from CUDA devices (or on the host)")
    if device == "cuda" and not torch.cuda.is_available():
        reasons.append("the trainer's device is CUDA but torch.cuda is not available in this process")
    replicas = data_parallel_reason(trainer, "the offloading forward is bound to each layer instance")
    if replicas:
        reasons.append(replicas)
    return reasons


def local_processes() -> int:
    """The training processes on this host (the launchers' LOCAL_WORLD_SIZE; 1 without one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


def budget_for(max_host_gib: float, trainer: Any) -> tuple[int, str]:
    """The host bytes one process may hold, and how that was decided (the report says)."""
    if max_host_gib > 0:
        return host_budget_bytes(max_host_gib, 0, 1), f"offload_checkpoints_max_host_gib={max_host_gib:g}"
    available = available_host_bytes()
    local = local_processes()
    share = f" shared by {local} processes" if local > 1 else ""
    return host_budget_bytes(0, available, local), f"half of the {size_text(available)} host memory available{share}"


def available_host_bytes() -> int:
    """MemAvailable (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bytes_per_token(model: nn.Module) -> int:
    """One token of a layer input: the hidden size x the embeddings' element size (the hidden states' dtype)."""
    hidden = int(getattr(text_config(model.config), "hidden_size", 0) or 0)
    embeddings = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    size = weight.element_size() if isinstance(weight, torch.Tensor) and weight.is_floating_point() else 2
    return hidden * size


def describe(plan: OffloadPlan) -> str:
    per_token = size_text(plan.bytes_per_token)
    some = f"{len(plan.layers)} of {plan.total_layers}" if len(plan.layers) < plan.total_layers else len(plan.layers)
    layers = f"the checkpointed inputs of {some} decoder layers ({per_token} a token each)"
    if plan.device != "cuda":
        text = f"{layers} to host copies (the model is on the host: no device memory to save)"
    else:
        text = f"{layers} to pinned host memory on a side stream, copied back one layer ahead of the backward"
        if plan.tokens_per_micro_batch:
            step = plan.bytes_per_token * plan.tokens_per_micro_batch * max(len(plan.layers) - 1, 0)
            text += (
                f"; about {size_text(step)} kept off the device for a micro-batch of {plan.tokens_per_micro_batch} "
                "tokens (the last of these inputs stays)"
            )
    if plan.min_tokens:
        text += (
            f"; auto mode moves those of micro-batches of at least {plan.min_tokens} tokens (from there its step cost "
            f"measured within {measured.MAX_COST:.0%}); shorter ones keep stock checkpointing "
            "(offload_checkpoints=True moves every micro-batch's)"
        )
    if plan.embedding is not None:
        text += (
            "; an embedding output that PEFT's input-gradient hook alone makes require grad goes on without that "
            "unused gradient (autograd would hold it until the backward ends)"
        )
    return f"{text}; host memory bounded at {size_text(plan.budget_bytes)} ({plan.budget_source})"
