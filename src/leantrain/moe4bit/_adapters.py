"""PEFT LoRA adapters on 4-bit experts: which placements the grouped path serves (with precise reasons for the
others) and, per call, the active adapters' per-expert factors for ``lora.split_lora``.

Two placements:
- ``lists``: PEFT ``lora.Linear4bit`` wrapping each expert's ``bnb.nn.Linear4bit`` in ``gate_up_projs`` /
  ``down_projs`` (``target_modules="all-linear"`` or the list names). Per call one ``torch.stack`` of the E
  ``lora_A`` and E ``lora_B`` weights per projection (E x r x (in + out) elements: 6 MB in bf16 for a Qwen3-30B-A3B
  layer's gate_up at r=16).
- ``stacked``: PEFT ``target_parameters`` LoRA (``ParamWrapper``, nested once per targeted stack) on 3-D stacks
  quantized by :func:`leantrain.quantize_experts_4bit`. PEFT matches an already-parametrized parameter only by its
  full name: :func:`expert_lora_targets` lists those names. ``lora_A`` ``[r*E, in]`` and ``lora_B`` ``[out, r*E]``
  are viewed per expert (B needs one small copy per call: its expert index is the fastest one).

PEFT's own forward on such a stack is wrong (peft 0.21.2, see :func:`stock_forward`, the fallback that replaces it):
with leantrain patched, the grouped path or that fallback serves every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .lora import LoraFactors
from .quantize import STACK_NAMES


@dataclass
class Adapters:
    """What one grouped call adds: the active adapters' factors per projection (empty: adapters disabled)."""

    gate_up: list[LoraFactors]
    down: list[LoraFactors]
    training: bool  # dropout applies in training only


AdaptersFor = Callable[[], Adapters]


def _is_param_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ == "ParamWrapper" and hasattr(module, "parameter_name")


def _is_tuner(module: nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", None), nn.Module)


def wrapped_map(model: nn.Module) -> dict[int, nn.Module]:
    """``id(base_layer) -> wrapper`` for every PEFT tuner layer of ``model`` (LoRA on a layer or a parameter)."""
    return {id(m.base_layer): m for m in model.modules() if _is_tuner(m)}


def param_wrappers(wrapped: dict[int, nn.Module], experts: nn.Module) -> list[nn.Module]:
    """The PEFT ``ParamWrapper`` chain around ``experts``, outermost first (empty when none)."""
    chain, node = [], wrapped.get(id(experts))
    while node is not None and _is_param_wrapper(node):
        chain.append(node)
        node = wrapped.get(id(node))
    return chain[::-1]


def forward_owner(wrapped: dict[int, nn.Module], experts: nn.Module) -> nn.Module:
    """The module whose forward the MoE block calls: the outermost ParamWrapper around the experts, or the experts."""
    chain = param_wrappers(wrapped, experts)
    return chain[0] if chain else experts


def expert_lora_targets(model: nn.Module, names: tuple[str, ...] = STACK_NAMES) -> list[str]:
    """Names of the 4-bit 3-D expert stacks for ``LoraConfig(target_parameters=...)``.

    PEFT (0.21) matches a parameter that is already parametrized (as :func:`leantrain.quantize_experts_4bit` leaves
    the stacks) only by the exact path of its module, so suffixes such as ``"mlp.experts.gate_up_proj"`` match
    nothing there. That path gains one ``.base_layer`` per PEFT wrapper once a first adapter is added, and PEFT
    requires every ``target_parameters`` adapter to list the same names: so the list holds each stack's path at
    every wrapper depth (names that match nothing are ignored by PEFT). Call it on the quantized model (before
    ``get_peft_model``) or on the PEFT model (for ``add_adapter``): the same list either way."""
    from torch.nn.utils import parametrize

    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    found = set()
    for module_name, module in root.named_modules():
        for name in names:
            if parametrize.is_parametrized(module, name):
                original = module.parametrizations[name].original
                if original.dtype == torch.uint8 and hasattr(module.parametrizations[name][0], "quant_state"):
                    path = module_name.replace(".base_layer", "")
                    found.update(f"{path}{'.base_layer' * depth}.{name}" for depth in range(len(names) + 1))
    return sorted(found)


class _Delta(nn.Module):
    """Adds a fixed delta to a parametrized stack on access (the fallback's per-expert LoRA, as PEFT folds it)."""

    def __init__(self, delta: torch.Tensor) -> None:
        super().__init__()
        self.delta = delta

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta.to(weight.dtype)


def stock_forward(experts: nn.Module, chain: list[nn.Module]) -> Callable:
    """The per-expert fallback for ``target_parameters`` LoRA on 4-bit stacks: PEFT's own ``get_delta_weight`` of
    every active adapter added on access to the dequantized stack, then the stock experts forward.

    PEFT's ``ParamWrapper.forward`` cannot serve here: on an already-parametrized stack its nested wrappers read
    the inner stack inside the outer one's ``parametrize.cached()`` before registering their proxy (the inner
    adapter is silently dropped), and ``_remove_parametrizations`` leaves the ``_LoraFactorsProxy`` registered,
    so the next forward raises (peft 0.21.2)."""
    from torch.nn.utils import parametrize

    def forward(hidden_states, *args, **kwargs):
        added = []
        try:
            for wrapper in chain:
                active = (
                    [] if wrapper.disable_adapters else [a for a in wrapper.active_adapters if a in wrapper.lora_A]
                )
                if active:
                    delta = sum(wrapper.get_delta_weight(a) for a in active)
                    parametrize.register_parametrization(experts, wrapper.parameter_name, _Delta(delta), unsafe=True)
                    added.append(wrapper.parameter_name)
            return experts(hidden_states, *args, **kwargs)
        finally:
            for name in added:
                del experts.parametrizations[name][-1]

    return forward


# ------------------------------------------------------------------------------------------------------ reasons


def _adapter_reason(layer: nn.Module, adapter: str, what: str) -> str | None:
    """Per adapter on one tuner layer: the LoRA options the split grouped path reproduces."""
    if getattr(layer, "use_dora", {}).get(adapter, False) or adapter in getattr(layer, "lora_magnitude_vector", {}):
        return f"{what} use DoRA: the grouped path serves plain LoRA on experts (no magnitude vector)"
    if adapter in getattr(layer, "lora_variant", {}):
        name = type(layer.lora_variant[adapter]).__name__
        return f"{what} use the LoRA variant {name}: the grouped path serves plain LoRA on experts"
    if getattr(layer, "lora_bias", {}).get(adapter, False):
        return f"{what} carry a LoRA bias (lora_bias=True): not served on experts"
    if adapter in getattr(layer, "lora_embedding_A", {}):
        return f"{what} carry embedding LoRA weights"
    return None


def _common_reason(layer: nn.Module, what: str) -> str | None:
    if not hasattr(layer, "lora_A") or not hasattr(layer, "lora_B"):
        return (
            f"{what} carry a {type(layer).__name__} adapter (not LoRA): the grouped path serves LoRA only "
            "(LoHa, LoKr, IA3, ... run the per-expert loop)"
        )
    if getattr(layer, "merged", False):
        return f"{what} have merged LoRA adapters: unmerge them (model.unmerge_adapter()) to train on the grouped path"
    for adapter in layer.lora_A:
        reason = _adapter_reason(layer, adapter, what)
        if reason:
            return reason
    return None


def lists_reason(ups: list[nn.Module], downs: list[nn.Module]) -> str | None:
    """None when every expert Linear4bit is plain or every one carries servable PEFT LoRA adapters."""
    layers = ups + downs
    tuned = [m for m in layers if _is_tuner(m) or hasattr(m, "lora_A")]
    if not tuned:
        return None
    if len(tuned) != len(layers):
        return "LoRA adapters sit on some experts only: the grouped path needs every expert adapted alike"
    for layer in layers:
        reason = _common_reason(layer, "expert adapters")
        if reason:
            return reason
        if _is_tuner(layer.base_layer):
            return "expert Linear4bit layers are wrapped twice by PEFT tuners"
        bias = getattr(layer.base_layer, "bias", None)
        if bias is not None and bias.requires_grad:
            return (
                "expert biases require grad (PEFT bias='all' or 'lora_only'): the grouped path trains no expert biases"
            )
    for group in (ups, downs):
        first = group[0]
        key = _lists_key(first)
        if any(_lists_key(m) != key for m in group[1:]):
            return (
                "experts differ in their LoRA adapters (names, ranks, scaling or dropout): the grouped path needs "
                "the same adapters on every expert"
            )
    return None


def _lists_key(layer: nn.Module) -> tuple:
    return tuple(
        (a, int(layer.r[a]), float(layer.scaling[a]), _dropout_p(layer.lora_dropout[a]), layer.lora_A[a].weight.dtype)
        for a in sorted(layer.lora_A)
    )


def _dropout_p(module: nn.Module) -> float:
    if isinstance(module, nn.Identity):
        return 0.0
    if type(module) is nn.Dropout:
        return float(module.p)
    raise TypeError(f"unknown LoRA dropout module {type(module).__name__}")


def stacked_reason(experts: nn.Module, wrapped: dict[int, nn.Module]) -> str | None:
    """None when the experts module carries no PEFT wrapper or only servable ``target_parameters`` LoRA."""
    chain = param_wrappers(wrapped, experts)
    if not chain:
        if id(experts) in wrapped:  # a tuner other than ParamWrapper wraps the whole experts module
            return "the experts module is wrapped by a PEFT tuner that is not target_parameters LoRA"
        return None
    names = [w.parameter_name for w in chain]
    if not set(names) <= set(STACK_NAMES):
        return f"LoRA targets expert parameters {names}: the grouped path serves {list(STACK_NAMES)}"
    for wrapper in chain:
        reason = _common_reason(wrapper, f"expert stack {wrapper.parameter_name} adapters")
        if reason:
            return reason
        if int(getattr(wrapper, "num_experts", 0)) < 1:
            return "a target_parameters LoRA wrapper does not know its experts count"
    return None


# --------------------------------------------------------------------------------------------------- per call


def _compute(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors in the dtype PEFT's LoRA matmuls run in: the autocast dtype under autocast, else their own."""
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
        return a.to(dtype), b.to(dtype)
    return a, b


def _active(layer: nn.Module) -> list[str]:
    if layer._forward_pre_hooks:  # PEFT's mixed-adapter batches (adapter_names) pass through per-layer hooks
        raise RuntimeError("expert LoRA layers carry forward hooks (PEFT adapter_names): served by the stock loop")
    if getattr(layer, "disable_adapters", False):
        return []
    if getattr(layer, "merged", False):
        raise RuntimeError("expert LoRA adapters were merged after patching")
    return [a for a in layer.active_adapters if a in layer.lora_A]


def lists_adapters(experts: nn.Module, ups: list[nn.Module], downs: list[nn.Module]) -> AdaptersFor:
    """Per call: the active adapters of the per-expert ``lora.Linear4bit`` layers, stacked per projection."""

    def factors(layers: list[nn.Module]) -> list[LoraFactors]:
        first, last = layers[0], layers[-1]
        active = _active(first)
        if _active(last) != active:
            raise RuntimeError("experts have different active LoRA adapters")
        out = []
        for name in active:
            a = torch.stack([m.lora_A[name].weight for m in layers])  # [E, r, in]
            b = torch.stack([m.lora_B[name].weight for m in layers])  # [E, out, r]
            a, b = _compute(a, b, a.device)
            out.append(LoraFactors(a, b, float(first.scaling[name]), _dropout_p(first.lora_dropout[name])))
        return out

    def adapters_for() -> Adapters:
        return Adapters(factors(ups), factors(downs), experts.training)

    return adapters_for


def _wrapper_factors(wrapper: nn.Module, dtype: torch.dtype) -> list[LoraFactors]:
    """The active adapters of one ParamWrapper in the stack's dtype: PEFT folds ``W + s·A·B`` in W's dtype with
    autocast off, whatever the adapters' own dtype (fp32 under ``autocast_adapter_dtype``)."""
    experts = int(wrapper.num_experts)
    out = []
    for name in _active(wrapper):
        a = wrapper.lora_A[name].weight  # [r*E, in]: expert e's rows e*r .. (e+1)*r
        b = wrapper.lora_B[name].weight  # [out, r*E]: expert e's columns e, E + e, ... (expert index fastest)
        a = a.view(experts, -1, a.shape[-1]).to(dtype)
        b = b.view(b.shape[0], -1, experts).permute(2, 0, 1).to(dtype)  # [E, out, r], strided: split_lora copies it
        out.append(LoraFactors(a, b, float(wrapper.scaling[name]), 0.0))  # ParamWrapper refuses dropout
    return out


def stacked_adapters(wrapped: dict[int, nn.Module], experts: nn.Module) -> AdaptersFor:
    """Per call: the active adapters of the ParamWrapper chain around a 4-bit stacked experts module."""
    by_name = {w.parameter_name: w for w in param_wrappers(wrapped, experts)}

    def factors(name: str) -> list[LoraFactors]:
        wrapper = by_name.get(name)
        if wrapper is None:
            return []
        return _wrapper_factors(wrapper, experts.parametrizations[name][0].quant_state.dtype)

    def adapters_for() -> Adapters:
        return Adapters(factors(STACK_NAMES[0]), factors(STACK_NAMES[1]), experts.training)

    return adapters_for


def is_tuned(layer: nn.Module) -> bool:
    return _is_tuner(layer) or hasattr(layer, "lora_A")


def base(layer: nn.Module) -> nn.Module:
    """The layer a PEFT tuner wraps (the layer itself when not wrapped)."""
    return layer.base_layer if _is_tuner(layer) else layer


def adapters_for(found_layout: str, experts: nn.Module, wrapped: dict[int, nn.Module]) -> AdaptersFor | None:
    """The per-call adapters provider of a ready experts module, or None when it carries no adapters."""
    if found_layout == "stacked":
        return stacked_adapters(wrapped, experts) if param_wrappers(wrapped, experts) else None
    if found_layout != "linear4bit":  # per-expert MLP modules: their probe declines adapters
        return None
    ups, downs = list(experts.gate_up_projs), list(experts.down_projs)
    return lists_adapters(experts, ups, downs) if any(is_tuned(m) for m in ups + downs) else None


def with_adapters(plan_for: Callable, adapters: AdaptersFor | None) -> Callable:
    """``plan_for`` whose plans carry the adapters provider (unchanged when the experts carry no adapters)."""
    if adapters is None:
        return plan_for

    def planned(hidden_states, indices, weights):
        return dataclasses.replace(plan_for(hidden_states, indices, weights), adapters=adapters)

    return planned


def owner_forward(make: Callable, owner: nn.Module, experts: nn.Module, wrapped: dict[int, nn.Module]) -> Callable:
    """``Undo.wrap_method`` factory for the owner's forward. Under a ParamWrapper chain the fallback is
    :func:`stock_forward` instead of PEFT's forward (see there)."""
    if owner is experts:
        return make
    chain = param_wrappers(wrapped, experts)
    return lambda original: make(stock_forward(experts, chain))


def lora_detail(providers: list[AdaptersFor]) -> str:
    """The report's words on expert LoRA: how many modules carry it, and whether its GEMMs leave the fast path."""
    if not providers:
        return ""
    text = f"; expert LoRA as split grouped GEMMs on {len(providers)} modules"
    sample = providers[0]()
    factors = sample.gate_up + sample.down
    if factors and factors[0].a.dtype == torch.float32 and factors[0].a.device.type == "cuda":
        text += (
            " (in float32, the adapters' dtype: torch's grouped_mm runs one GEMM per expert there; train under bf16 "
            "autocast or cast the adapters to bf16 for the fast path)"
        )
    return text
