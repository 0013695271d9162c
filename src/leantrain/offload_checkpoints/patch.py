"""What ``apply`` installs: every decoder layer's checkpoint function inside the offload hooks.

Transformers checkpoints a ``GradientCheckpointingLayer`` by calling the instance's ``_gradient_checkpointing_func``
(``torch.utils.checkpoint.checkpoint`` with the trainer's keyword arguments) on the layer's forward; the hooks
entered around that call see the checkpoint's saved inputs only, in every transformers version (the call sits in
``__call__`` on older releases, in ``forward`` on newer ones) and whatever runs inside (``compile_layers``' compiled
forward stays inside the checkpoint). The trainer sets that function when it switches checkpointing on, which may
come after ``patch_trainer`` (at ``train()``): a callback wraps any function set since, at the start of training and
of every step (a check per layer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..fallback import RuntimeFallback
from ..undo import Undo
from .ops import EmbeddingOutput, HostOffload
from .probe import OffloadPlan


STATS_ATTR = "leantrain_offload_checkpoints"  # on the trainer: the live OffloadStats
HOOKS_ATTR = "leantrain_offload_hooks"  # on the trainer: the HostOffload (its ``paused`` switch)
FUNC_ATTR = "_gradient_checkpointing_func"  # transformers' per-layer checkpoint function
INNER = "__leantrain_offload_inner__"  # on a wrapped function: the checkpoint function it wraps


def install(plan: OffloadPlan, undo: Undo, fallback: RuntimeFallback, trainer: Any) -> tuple[str, ...]:
    """Wrap every planned layer's checkpoint function now and whenever the trainer sets a new one (each recorded on
    ``undo``); the qualified names."""
    offload = HostOffload(
        plan.budget_bytes,
        plan.min_bytes,
        on_failure=lambda reason: _failed(fallback, reason),
        min_tokens=plan.min_tokens,
    )
    embedding = EmbeddingOutput()
    if plan.embedding is not None:
        recorder = plan.embedding.register_forward_hook(embedding.record)
        undo.push(recorder.remove)
    layers = [layer for _, layer in plan.layers]
    wrap_layers(layers, offload, embedding)
    hook = plan.trunk.register_forward_pre_hook(lambda module, args: wrap_layers(layers, offload, embedding))
    undo.push(lambda: (hook.remove(), unwrap_layers(layers)))
    undo.set_attr(trainer, STATS_ATTR, offload.stats)
    undo.set_attr(trainer, HOOKS_ATTR, offload)
    return tuple(name for name, _ in plan.layers)


def offloading(
    offload: HostOffload, checkpoint_func: Callable[..., Any], embedding: EmbeddingOutput | None = None
) -> Callable[..., Any]:
    """``checkpoint_func`` called inside the offload hooks (outside them once the offload failed or while it is
    paused); the embedding output that only PEFT's input-gradient hook made require grad is handed on without that
    gradient (``ops.GradientSink``), so autograd does not hold it through the backward."""

    def checkpoint_offloaded(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if offload.failed or offload.paused or not torch.is_grad_enabled():
            return checkpoint_func(function, *args, **kwargs)
        if embedding is not None and args and embedding.only_hook_made(args[0]):
            args = (embedding.sink(args[0]), *args[1:])
            offload.stats.sunk += 1
        with offload.context():
            return checkpoint_func(function, *args, **kwargs)

    setattr(checkpoint_offloaded, INNER, checkpoint_func)
    return checkpoint_offloaded


def wrap_layers(layers: list[torch.nn.Module], offload: HostOffload, embedding: EmbeddingOutput | None = None) -> None:
    for layer in layers:
        func = vars(layer).get(FUNC_ATTR)
        if func is not None and not hasattr(func, INNER):
            setattr(layer, FUNC_ATTR, offloading(offload, func, embedding))


def unwrap_layers(layers: list[torch.nn.Module]) -> None:
    for layer in layers:
        inner = getattr(vars(layer).get(FUNC_ATTR), INNER, None)
        if inner is not None:
            setattr(layer, FUNC_ATTR, inner)


def _failed(fallback: RuntimeFallback, reason: str) -> None:
    """Host memory could not be had: every later input stays on the device (stock checkpointing), warned once."""
    message = f"{reason}; the checkpointed layer inputs stay on the device (stock checkpointing) from now on"
    if fallback.strict:
        raise RuntimeError(f"offload_checkpoints: {message}")
    fallback.fail(message)
