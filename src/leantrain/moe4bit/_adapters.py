"""PEFT LoRA adapters on 4-bit experts: which placements the grouped path serves (with precise reasons for the
others), where a ready module's adapters are (each layout's ``Layout.adapters``, for the probe's plan) and, per call,
the active adapters' per-expert factors for ``lora.add_lora`` (:func:`provider`, built by ``apply``).

Per-expert layers, in two layouts:
- ``linear4bit`` lists: PEFT ``lora.Linear4bit`` wrapping each expert's ``bnb.nn.Linear4bit`` in ``gate_up_projs`` /
  ``down_projs`` (``target_modules="all-linear"`` or the list names);
- ``expert_mlps``: the same on each expert MLP's ``gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral: ``w1`` /
  ``w3`` / ``w2``) of a transformers 4.x sparse MoE block; gate and up are two adapters whose outputs are the two
  halves of the block's consolidated gate_up stack (:class:`Piece`).
At patch time each adapter's E ``lora_A`` (and E ``lora_B``) weights of a projection are re-homed as slices of one
``[E, r, in]`` (``[E, out, r]``) buffer (:class:`FactorStack`): the grouped GEMMs read the buffer with no copy per
call, the parameters stay PEFT's objects (optimizer updates land in the buffer; saving and loading are unchanged) and
each gets its slice of the gradient. Parameters re-homed after patching (an adapter added later, DeepSpeed's flat
buffers, a move) are stacked per call instead.

Stacks: PEFT ``target_parameters`` LoRA (``ParamWrapper``, nested once per targeted stack) on 3-D stacks quantized by
:func:`leantrain.quantize_experts_4bit`. PEFT matches an already-parametrized parameter only by its full name:
:func:`expert_lora_targets` lists those names. ``lora_A`` ``[r*E, in]`` and ``lora_B`` ``[out, r*E]`` are viewed
per expert (B needs one small copy per call: its expert index is the fastest one). PEFT's own forward on such a
stack is wrong (peft 0.21.2, see :func:`stock_forward`, the fallback that replaces it): with leantrain patched, the
grouped path or that fallback serves every call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ._stacks import STACK_NAMES, Record
from .lora import LoraFactors, stacked
from .saved import clone_shared_on_save


@dataclass
class Adapters:
    """What one grouped call adds: per projection, one tuple of column pieces per active adapter (``lora.add_lora``;
    empty: adapters disabled)."""

    gate_up: list[tuple[LoraFactors, ...]]
    down: list[tuple[LoraFactors, ...]]
    training: bool  # dropout applies in training only


@dataclass(frozen=True)
class Piece:
    """Per-expert PEFT LoRA layers (in expert order) whose outputs start at column ``start`` of a projection stack."""

    layers: tuple[nn.Module, ...]
    start: int = 0


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


def stock_lora_breaks(model: nn.Module, experts: list[nn.Module]) -> bool:
    """Whether PEFT's own LoRA forward cannot serve one of ``experts``: a parametrized (4-bit) stack under PEFT
    ``ParamWrapper``s, where the nested wrappers drop the inner adapter and leave their proxy registered, so the
    next forward fails (``stock_forward`` says how; peft 0.21.2)."""
    wrapped = wrapped_map(model)
    return any(torch.nn.utils.parametrize.is_parametrized(e) and param_wrappers(wrapped, e) for e in experts)


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


def stock_forward(experts: nn.Module, chain: list[nn.Module], as_stock: Callable = lambda call: call) -> Callable:
    """The per-expert fallback for ``target_parameters`` LoRA on 4-bit stacks: PEFT's own ``get_delta_weight`` of
    every active adapter added on access to the dequantized stack, then the stock experts forward (the experts' own
    call as ``as_stock`` runs it: the layout's, e.g. under the parametrization cache, entered only once the adapters'
    deltas are registered, so that no stack is cached without them).

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
            return as_stock(experts)(hidden_states, *args, **kwargs)
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


def per_expert_reason(groups: dict[str, list[nn.Module]]) -> str | None:
    """None when each projection's per-expert layers (by name) are all plain or all carry the same servable PEFT
    LoRA adapters (a projection without adapters is served next to one with them)."""
    for label, layers in groups.items():
        tuned = [m for m in layers if is_tuned(m)]
        if not tuned:
            continue
        if len(tuned) != len(layers):
            return (
                f"LoRA adapters sit on some experts only ({label}: {len(tuned)} of {len(layers)}): the grouped path "
                "needs every expert adapted alike"
            )
        for layer in layers:
            reason = _common_reason(layer, "expert adapters")
            if reason:
                return reason
            if _is_tuner(layer.base_layer):
                return "expert Linear4bit layers are wrapped twice by PEFT tuners"
            bias = getattr(layer.base_layer, "bias", None)
            if bias is not None and bias.requires_grad:
                return (
                    "expert biases require grad (PEFT bias='all' or 'lora_only'): the grouped path trains no expert "
                    "biases"
                )
        key = _lists_key(layers[0])
        if any(_lists_key(m) != key for m in layers[1:]):
            return (
                f"experts differ in their LoRA adapters ({label}: names, ranks, scaling or dropout): the grouped path "
                "needs the same adapters on every expert"
            )
    return None


def adapter_key(layer: nn.Module) -> tuple | None:
    """What the readiness of a per-expert layer's adapters depends on (host reads only; None: no adapters)."""
    if not is_tuned(layer):
        return None
    adapters = tuple(sorted(getattr(layer, "lora_A", {})))
    options = tuple(
        (a, getattr(layer, n, {}).get(a) if isinstance(getattr(layer, n, None), dict) else None)
        for a in adapters
        for n in ("r", "scaling", "use_dora", "lora_bias")
    )
    variants = tuple(sorted(getattr(layer, "lora_variant", {})))
    return (type(layer), adapters, options, variants, getattr(layer, "merged", False))


def _lists_key(layer: nn.Module) -> tuple:
    return tuple(
        (a, int(layer.r[a]), float(layer.scaling[a]), _dropout_p(layer.lora_dropout[a]))
        + tuple((w.dtype, w.device) for w in (layer.lora_A[a].weight, layer.lora_B[a].weight))
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


@dataclass
class FactorStack:
    """One adapter's ``lora_A`` or ``lora_B`` weights on the per-expert layers of a piece, re-homed at patch time as
    the slices of ``buffer`` ``[E, rows, cols]`` (:func:`stack_factor`)."""

    layers: tuple[nn.Module, ...]
    adapter: str
    factor: str  # "lora_A" | "lora_B"
    params: tuple[nn.Parameter, ...]
    buffer: torch.Tensor
    last_ptr: int  # buffer[-1].data_ptr()

    def current(self, layer: nn.Module) -> nn.Parameter:
        return getattr(layer, self.factor)[self.adapter].weight

    def live(self) -> bool:
        """The layers still hold these parameters and they still view the buffer. The first and last expert are
        read (host attributes only): whatever re-homes parameters (a move, DeepSpeed's flat buffers, an assigning
        ``load_state_dict``) re-homes them all."""
        first, last = self.params[0], self.params[-1]
        return (
            self.current(self.layers[0]) is first
            and self.current(self.layers[-1]) is last
            and first.data_ptr() == self.buffer.data_ptr()
            and last.data_ptr() == self.last_ptr
            and first.dtype == self.buffer.dtype
            and first.device == self.buffer.device
        )

    def tensor(self) -> torch.Tensor:
        """``[E, rows, cols]``: the buffer (no copy; gradients reach each parameter) while live, else one
        ``torch.stack`` of the layers' current parameters."""
        if self.live():
            return stacked(self.buffer, self.params)
        return torch.stack([self.current(m) for m in self.layers])


def stack_factor(layers: tuple[nn.Module, ...], adapter: str, factor: str, record: Record) -> FactorStack:
    """Re-home every expert's ``factor`` weight of ``adapter`` as a slice of one new buffer (the same values); each
    restore step (a private copy again) goes to ``record`` as soon as its change is made."""
    params = tuple(getattr(m, factor)[adapter].weight for m in layers)
    buffer = torch.stack([p.detach() for p in params])
    for e, param in enumerate(params):
        param.data = buffer[e]
        record(lambda param=param: setattr(param, "data", param.data.clone()))
    return FactorStack(layers, adapter, factor, params, buffer, buffer[-1].data_ptr())


def _factors(piece: Piece, name: str, stacks: dict) -> LoraFactors:
    first = piece.layers[0]
    pair = stacks.get((id(piece), name))
    if pair is not None:
        a, b = pair[0].tensor(), pair[1].tensor()
    else:  # an adapter added after patching: stacked per call
        a = torch.stack([m.lora_A[name].weight for m in piece.layers])  # [E, r, in]
        b = torch.stack([m.lora_B[name].weight for m in piece.layers])  # [E, out, r]
    a, b = _compute(a, b, a.device)
    return LoraFactors(a, b, float(first.scaling[name]), _dropout_p(first.lora_dropout[name]), piece.start)


def _projection(pieces: tuple[Piece, ...], stacks: dict) -> list[tuple[LoraFactors, ...]]:
    """Per active adapter (in PEFT's order), the pieces of this projection that carry it."""
    actives = []
    for piece in pieces:
        active = _active(piece.layers[0])
        if _active(piece.layers[-1]) != active:
            raise RuntimeError("experts have different active LoRA adapters")
        actives.append(active)
    names = list(dict.fromkeys(name for active in actives for name in active))
    return [
        tuple(_factors(piece, name, stacks) for piece, active in zip(pieces, actives) if name in active)
        for name in names
    ]


def per_expert_adapters(
    experts: nn.Module, gate_up: tuple[Piece, ...], down: tuple[Piece, ...], record: Record
) -> AdaptersFor:
    """Re-home every adapter's factors of the per-expert ``lora.Linear4bit`` layers as stacks (now, recording each
    restore step); per call, the active adapters' factors per projection piece."""
    stacks = {}
    for piece in gate_up + down:
        for name in piece.layers[0].lora_A:
            factors = ("lora_A", "lora_B")
            stacks[(id(piece), name)] = tuple(stack_factor(piece.layers, name, f, record) for f in factors)

    clone_shared_on_save(experts, [s.buffer for pair in stacks.values() for s in pair], record)

    def adapters_for() -> Adapters:
        return Adapters(_projection(gate_up, stacks), _projection(down, stacks), experts.training)

    return adapters_for


def _wrapper_factors(wrapper: nn.Module, dtype: torch.dtype) -> list[tuple[LoraFactors, ...]]:
    """The active adapters of one ParamWrapper in the stack's dtype: PEFT folds ``W + s·A·B`` in W's dtype with
    autocast off, whatever the adapters' own dtype (fp32 under ``autocast_adapter_dtype``)."""
    experts = int(wrapper.num_experts)
    out = []
    for name in _active(wrapper):
        a = wrapper.lora_A[name].weight  # [r*E, in]: expert e's rows e*r .. (e+1)*r
        b = wrapper.lora_B[name].weight  # [out, r*E]: expert e's columns e, E + e, ... (expert index fastest)
        a = a.view(experts, -1, a.shape[-1]).to(dtype)
        b = b.view(b.shape[0], -1, experts).permute(2, 0, 1).to(dtype)  # [E, out, r], strided: split_lora copies it
        out.append((LoraFactors(a, b, float(wrapper.scaling[name]), 0.0),))  # ParamWrapper refuses dropout
    return out


def chain_adapters(chain: tuple[nn.Module, ...], experts: nn.Module) -> AdaptersFor:
    """Per call: the active adapters of the ParamWrapper chain around a 4-bit stacked experts module."""
    by_name = {w.parameter_name: w for w in chain}

    def factors(name: str) -> list[tuple[LoraFactors, ...]]:
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


@dataclass(frozen=True)
class AdapterSpec:
    """Where a ready experts module's PEFT adapters are (found by the probe): per-expert layers per projection
    (``gate_up`` / ``down`` pieces), or the ``target_parameters`` ParamWrapper chain around a 4-bit stack."""

    gate_up: tuple[Piece, ...] = ()
    down: tuple[Piece, ...] = ()
    chain: tuple[nn.Module, ...] = ()  # outermost first


def spec_of(gate_up: tuple[Piece, ...], downs: list[nn.Module]) -> AdapterSpec | None:
    """The adapters of a ready per-expert experts module (its layout cuts ``gate_up`` into pieces of the stack):
    the pieces whose layers carry LoRA (None: no adapters)."""
    tuned = [tuple(p for p in group if is_tuned(p.layers[0])) for group in (gate_up, (Piece(tuple(downs), 0),))]
    return AdapterSpec(tuned[0], tuned[1]) if tuned[0] or tuned[1] else None


def provider(spec: AdapterSpec | None, experts: nn.Module, record: Record) -> AdaptersFor | None:
    """The per-call adapters provider of ``spec`` (per-expert layers: their factors are re-homed as stacks now, each
    restore step going to ``record``); None without adapters."""
    if spec is None:
        return None
    if spec.chain:
        return chain_adapters(spec.chain, experts)
    return per_expert_adapters(experts, spec.gate_up, spec.down, record)


def with_adapters(plan_for: Callable, adapters: AdaptersFor | None) -> Callable:
    """``plan_for`` whose plans carry the adapters provider (unchanged when the experts carry no adapters)."""
    if adapters is None:
        return plan_for

    def planned(hidden_states, indices, weights):
        return dataclasses.replace(plan_for(hidden_states, indices, weights), adapters=adapters)

    return planned


def lora_detail(providers: list[AdaptersFor]) -> str:
    """The report's words on expert LoRA: how many modules carry it, and whether its GEMMs leave the fast path."""
    if not providers:
        return ""
    text = f"; expert LoRA as split grouped GEMMs on {len(providers)} modules"
    sample = providers[0]()
    factors = [lora for pieces in sample.gate_up + sample.down for lora in pieces]
    if factors and factors[0].a.dtype == torch.float32 and factors[0].a.device.type == "cuda":
        text += (
            " (adapters in float32: outside bf16 autocast they compute in float32, where torch's grouped_mm runs one "
            "GEMM per expert; Trainer(bf16=True) autocasts, or cast the adapters to bf16)"
        )
    return text
