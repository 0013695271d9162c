"""Find MoE experts modules by structure (no bitsandbytes needed to find them).

Two layouts:
- ``linear4bit``: ``gate_up_projs`` / ``down_projs`` ModuleLists of ``bnb.nn.Linear4bit`` (community pre-quantized
  gpt-oss checkpoints; ``F.linear`` orientation, gate/up interleaved, biases, dense ``[T, E]`` routing weights).
- ``stacked``: stock transformers 5.x experts whose 3-D ``gate_up_proj`` / ``down_proj`` were quantized by
  :func:`leantrain.quantize_experts_4bit` (bitsandbytes' 4-bit parametrization).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .quantize import STACK_NAMES


@dataclass
class Found:
    name: str
    module: nn.Module
    layout: str  # "linear4bit" | "stacked"


def _is_lists(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_projs", None), nn.ModuleList) and isinstance(
        getattr(module, "down_projs", None), nn.ModuleList
    )


def _is_stacked(module: nn.Module) -> bool:
    from torch.nn.utils import parametrize

    def ok(name: str) -> bool:
        param = module._parameters.get(name)
        return (param is not None and param.dim() == 3) or parametrize.is_parametrized(module, name)

    return all(ok(name) for name in STACK_NAMES)


def find_experts(model: nn.Module) -> list[Found]:
    """Every experts module of either layout (structural: needs no bitsandbytes)."""
    found = []
    for name, module in model.named_modules():
        if _is_lists(module):
            found.append(Found(name, module, "linear4bit"))
        elif _is_stacked(module):
            found.append(Found(name, module, "stacked"))
    return found


def _wrapped_ids(model: nn.Module) -> dict[int, nn.Module]:
    """Modules that a PEFT tuner layer wraps, by id, to their wrapper: LoRA on an expert or on an experts stack."""
    from ._adapters import wrapped_map

    return wrapped_map(model)


def _bnb_parametrization(module: nn.Module, name: str):
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization
    from torch.nn.utils import parametrize

    if not parametrize.is_parametrized(module, name):
        return None
    plist = module.parametrizations[name]
    if len(plist) != 1 or not isinstance(plist[0], Bnb4bitParametrization) or plist[0].quant_state is None:
        return None
    return plist


def is_4bit(found: Found) -> bool:
    import bitsandbytes as bnb

    if found.layout == "stacked":
        return all(_bnb_parametrization(found.module, n) is not None for n in STACK_NAMES)
    layers = list(found.module.gate_up_projs) + list(found.module.down_projs)
    return bool(layers) and all(isinstance(getattr(m, "base_layer", m), bnb.nn.Linear4bit) for m in layers)
