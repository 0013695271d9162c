"""Model surgery (dense → OSFT) with its undo, and the dense export (merge, state-dict conversion)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..models import unwrap_model
from ..undo import Undo
from .linear import FACTORS, OSFTLinear, dense_module, high_rank, is_conv1d, rebuild
from .probe import plan_targets


@dataclass
class Conversion:
    """What :func:`convert` did: the layers by qualified name, skipped targets, worst reconstruction error."""

    layers: dict[str, OSFTLinear]
    skipped: dict[str, str] = field(default_factory=dict)
    max_error: float = 0.0
    undo: Undo = field(default_factory=Undo)


def _svd_device(weight: torch.Tensor) -> torch.device:
    """The weight's device; a CPU weight is factored on the current GPU when there is one (then moved back)."""
    if weight.device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return weight.device


def _factor(module: nn.Module, ratio: float) -> tuple[OSFTLinear, float]:
    device = _svd_device(module.weight)
    if device == module.weight.device:
        return OSFTLinear.from_module(module, ratio)
    weight = module.weight
    try:
        weight.data = weight.data.to(device)
        layer, error = OSFTLinear.from_module(module, ratio)
    finally:
        weight.data = weight.data.to("cpu")
    return layer.to("cpu"), error


def _empty_like_target(module: nn.Module, ratio: float) -> OSFTLinear:
    weight = module.weight
    n, m = (weight.shape[1], weight.shape[0]) if is_conv1d(module) else tuple(weight.shape)
    layer = OSFTLinear(
        m,
        n,
        high_rank(n, m, ratio),
        bias=getattr(module, "bias", None),
        transposed=is_conv1d(module),
        weight_dtype=weight.dtype,
        device=weight.device,
        dtype=weight.dtype,
    )
    layer._source.append(module)
    return layer


def _broadcast_layer(layer: OSFTLinear, src: int, device: torch.device) -> None:
    """One broadcast of all six factors, packed (the backend may need them on ``device``)."""
    tensors = [getattr(layer, f).data for f in FACTORS]
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(device)
    dist.broadcast(flat, src=src)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _factor_all(
    named: list[tuple[str, nn.Module]], ratio: float, progress: bool
) -> tuple[list[OSFTLinear], list[float]]:
    """SVD every target. Distributed: round-robin over ranks, P targets per round in parallel, each broadcast from
    its owner, so every rank ends with bitwise identical factors (FSDP2 takes each rank's shard of its own copy)."""
    from tqdm.auto import tqdm

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    bar = tqdm(total=len(named), desc="OSFT: SVD of target linears", unit="linear", disable=not progress)
    layers: list[OSFTLinear] = []
    errors: list[float] = []
    for start in range(0, len(named), world):
        chunk = named[start : start + world]
        built: list[OSFTLinear] = []
        for i, (_, module) in enumerate(chunk):
            if world == 1 or i == rank:
                layer, error = _factor(module, ratio)
                errors.append(error)
            else:
                layer = _empty_like_target(module, ratio)
            built.append(layer)
        if world > 1:
            for i, ((_, module), layer) in enumerate(zip(chunk, built)):
                _broadcast_layer(layer, src=i, device=_svd_device(module.weight))
        layers.extend(built)
        bar.update(len(chunk))
    bar.close()
    return layers, errors


def convert(
    model: nn.Module,
    *,
    unfrozen_rank_ratio: float = 0.5,
    targets: Sequence[str] | None = None,
    progress: bool = True,
    planned: tuple[list[tuple[str, nn.Module]], dict[str, str]] | None = None,
) -> Conversion:
    """Replace the target linears of ``model`` (any wrapper) by :class:`OSFTLinear` in place.

    The replaced module keeps its identity: its weight storage is released now and refilled with the merged weight
    by ``conversion.undo()`` / :func:`merge`. Distributed (torch.distributed initialized): every rank must call it.
    ``planned``: the (targets, skipped) that :func:`plan_targets` already found for ``targets``.
    """
    high_rank(1, 1, unfrozen_rank_ratio)  # validates the ratio before any work
    base = unwrap_model(model)
    named, skipped = planned if planned is not None else plan_targets(base, targets)
    layers, errors = _factor_all(named, unfrozen_rank_ratio, progress)
    conversion = Conversion({}, skipped, max(errors, default=0.0))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and named:
        worst = torch.tensor([conversion.max_error], device=_svd_device(named[0][1].weight))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        conversion.max_error = float(worst)
    for (name, module), layer in zip(named, layers):
        parent, attr = _parent(base, name)
        setattr(parent, attr, layer)
        weight = module.weight
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)  # the factors replace it
        conversion.undo.push(lambda p=parent, a=attr, new=layer: _restore(p, a, new))
        conversion.layers[name] = layer
    return conversion


def _parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (root.get_submodule(parent_name) if parent_name else root), attr


def _restore(parent: nn.Module, attr: str, layer: OSFTLinear) -> None:
    """Undo of one target: the original module object comes back, holding the merged (trained) weight."""
    source = layer._source[0]
    current = getattr(parent, attr)
    if current is layer:
        dense_module(layer)  # writes into ``source``
    setattr(parent, attr, source)


def osft_layers(model: nn.Module) -> dict[str, OSFTLinear]:
    return {n: m for n, m in unwrap_model(model).named_modules() if isinstance(m, OSFTLinear)}


def merge(model: nn.Module) -> nn.Module:
    """Turn every OSFTLinear of ``model`` back into a dense ``nn.Linear`` / ``Conv1D`` (weights rebuilt in fp32,
    cast to the original dtype; the original module objects where known). In place; returns ``model``.
    Sharded factors are gathered, so under FSDP2 every rank must call it."""
    base = unwrap_model(model)
    for name, layer in osft_layers(base).items():
        parent, attr = _parent(base, name)
        setattr(parent, attr, dense_module(layer))
    return model


def dense_state_dict(state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` (of ``model`` or its unwrapped base, full tensors) with each target's six factors replaced by
    its dense ``weight``; keys keep their order, so stock ``from_pretrained`` loads the result."""
    layers = osft_layers(model)
    targets: dict[str, OSFTLinear] = {}
    for key in state_dict:
        prefix = key[: -len("U_high")]
        if key.endswith("U_high") and all(prefix + f in state_dict for f in FACTORS):
            layer = _layer_for(prefix.rstrip("."), layers)
            if layer is not None:
                targets[prefix] = layer
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        factor = next((f for f in FACTORS if key.endswith(f) and key[: -len(f)] in targets), None)
        if factor is None:
            out[key] = value
        elif factor == "U_high":
            prefix = key[: -len(factor)]
            layer = targets[prefix]
            factors = {f: state_dict[prefix + f] for f in FACTORS}
            out[prefix + "weight"] = rebuild(factors, layer.weight_dtype, layer.transposed)
    return out


def _layer_for(name: str, layers: Mapping[str, OSFTLinear]) -> OSFTLinear | None:
    if name in layers:
        return layers[name]
    return next((layer for n, layer in layers.items() if name.endswith("." + n) or n.endswith("." + name)), None)
