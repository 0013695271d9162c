"""A stack of blocks run as checkpointed layers, inside the offload hooks or not: the mechanism of
``offload_checkpoints`` without a model (tests/parity and tests/gpu)."""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from leantrain.offload_checkpoints.ops import HostOffload


def through_checkpoints(
    stack: torch.nn.ModuleList, x: torch.Tensor, offload: HostOffload | None, reentrant: bool, seen: list | None = None
) -> torch.Tensor:
    """``x`` through every block, each checkpointed (inside the offload's hooks when given); ``seen`` collects a weak
    reference to every block input."""
    for block in stack:
        if seen is not None:
            seen.append(weakref.ref(x))
        if offload is None:
            x = checkpoint(block, x, use_reentrant=reentrant)
        else:
            with offload.context():
                x = checkpoint(block, x, use_reentrant=reentrant)
    return x
