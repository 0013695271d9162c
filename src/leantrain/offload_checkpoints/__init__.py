"""Offloaded activation checkpoints: each checkpointed decoder layer's input kept in host memory, not on the GPU.

With activation checkpointing the forward keeps one tensor per layer on the device, the layer's input, until the
backward recomputes the layer from it: ``layers x tokens x hidden`` bytes, what grows with the context. This moves
each input to pinned host memory on a side stream as the forward goes on and copies it back one layer ahead of the
backward that needs it, so the copies run under the layers' compute. ``probe.py`` decides (does the trainer
checkpoint transformers' layers, on a device this serves, within a host budget; auto mode waits for the step cost to
be measured), ``patch.py`` binds the layers' forward inside the hooks, ``ops.py`` holds the hooks and the budget
arithmetic (plain values)."""

from __future__ import annotations

from typing import Any

from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from .probe import OffloadPlan, describe
from .probe import probe as probe_trainer  # the submodule keeps its name


@register
class OffloadCheckpoints(Optimization):
    name = "offload_checkpoints"

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        return probe_trainer(trainer, ctx)

    def apply(self, trainer: Any, plan: OffloadPlan, ctx: PatchContext) -> Applied:
        from .patch import install

        return Applied(install(plan, ctx.undo, ctx.fallback, trainer), describe(plan))


def stats(trainer: Any) -> Any:
    """The live counts of a patched trainer (``.packed``, ``.packed_bytes``, ``.peak_bytes``, ``.kept``, ...), or
    None."""
    from .patch import STATS_ATTR

    return getattr(trainer, STATS_ATTR, None)


def hooks(trainer: Any) -> Any:
    """The patched trainer's ``HostOffload``, or None: ``hooks(trainer).paused = True`` keeps the checkpointed inputs
    on the device (stock checkpointing) from the next layer on, ``False`` moves them again."""
    from .patch import HOOKS_ATTR

    return getattr(trainer, HOOKS_ATTR, None)


__all__ = ["OffloadCheckpoints", "OffloadPlan", "hooks", "stats"]
