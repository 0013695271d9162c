"""FSDP2 with the V factors sharded along M, so that one flat all-reduce covers every U and V coefficient.

Use ``leantrain.osft.fully_shard(module, mesh=..., ...)`` where you would call
``torch.distributed.fsdp.fully_shard``: it passes a ``shard_placement_fn`` that puts ``V_high``/``V_low`` of every
``OSFTLinear`` inside ``module`` on ``Shard(1)`` (when M divides evenly by the shard-group size, which FSDP2 requires
for dim 1; otherwise that target keeps ``Shard(0)`` and the projection all-gathers its V_high) and everything else on
FSDP's default ``Shard(0)``. The projection detects whichever layout it finds, so a model sharded by accelerate's
default FSDP2 prepare (all ``Shard(0)``) also trains correctly, at the cost of the V_high all-gathers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from .linear import OSFTLinear


def shard_placement_fn(module: nn.Module, shard_size: int) -> Callable[[nn.Parameter], Any]:
    """A ``shard_placement_fn`` for ``fully_shard(module)``: Shard(1) for OSFT V factors whose M divides evenly."""
    from torch.distributed.tensor import Shard

    v_params = {
        id(p)
        for layer in module.modules()
        if isinstance(layer, OSFTLinear) and layer.in_features % shard_size == 0
        for p in (layer.V_high, layer.V_low)
    }

    def place(param: nn.Parameter) -> Any:
        return Shard(1) if id(param) in v_params else None  # None: FSDP's default Shard(0)

    return place


def fully_shard(module: nn.Module, *, mesh: Any = None, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` with the OSFT placement (see the module docstring)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if "shard_placement_fn" in kwargs:
        raise ValueError("leantrain.osft.fully_shard sets shard_placement_fn itself")
    shard_size = mesh.size(mesh.ndim - 1) if mesh is not None else dist.get_world_size()
    return torch_fully_shard(module, mesh=mesh, shard_placement_fn=shard_placement_fn(module, shard_size), **kwargs)
