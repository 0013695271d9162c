"""The quantization state of a packed 4-bit expert stack follows its module.

bitsandbytes' ``Bnb4bitParametrization`` keeps the ``QuantState`` (absmax, code, nested absmax/code/offset) as a plain
attribute, not as buffers: ``module.to()`` / ``.cuda()`` / ``to_empty()`` move the packed bytes but not the state, and
the CUDA dequantize kernel then reads host pointers: an illegal memory access, which poisons the CUDA context so no
fallback can recover. :class:`FollowingParametrization` (what :func:`leantrain.quantize_experts_4bit` installs) moves
every state tensor with its module, bit for bit. A dtype change (``.to(torch.bfloat16)``, ``.half()``) never touches
the uint8 codes or the fp32 absmax: it re-targets the dtype the stack dequantizes to, as it would cast a float
parameter. :func:`load_state` reads back the quantization state that bitsandbytes' save hook writes
(``saved.load_pre_hook``), so ``state_dict`` -> ``load_state_dict`` round-trips.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bitsandbytes import functional as bnbf
from bitsandbytes.nn.parametrize import Bnb4bitParametrization

from ._stacks import state_tensors


def _set_state_tensor(qs: bnbf.QuantState, name: str, value: torch.Tensor) -> None:
    if name.startswith("nested_"):
        setattr(qs.state2, name.removeprefix("nested_"), value)
    else:
        setattr(qs, name, value)


def _apply_bitwise(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """``fn`` (a module ``_apply`` function: a move, a cast, ``to_empty``) on the bytes of ``t``: ``Module.to`` never
    casts integer tensors, so a dtype change cannot round absmax. Returns ``t`` itself when nothing moved."""
    raw = t.reshape(-1).view(torch.uint8)
    moved = fn(raw)
    if moved is raw or (moved.device == raw.device and moved.data_ptr() == raw.data_ptr() and raw.numel()):
        return t
    if moved.dtype != torch.uint8 or moved.numel() != raw.numel():
        raise RuntimeError(
            "this module conversion changes the bytes of the 4-bit quantization state (an integer cast): "
            "only device moves and float dtype changes are supported for quantized experts"
        )
    return moved.view(t.dtype).view(t.shape)


class FollowingParametrization(Bnb4bitParametrization):
    """bitsandbytes' 4-bit dequantizing parametrization whose quantization state moves with the module."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FollowingParametrization:
        super()._apply(fn, recurse)
        qs = self.quant_state
        if qs is None:
            return self
        # What the conversion does to a float tensor of this stack's dequantized dtype, on the state's device.
        target = fn(torch.empty(0, dtype=qs.dtype, device=qs.absmax.device))
        for name, t in state_tensors(qs).items():
            _set_state_tensor(qs, name, _apply_bitwise(fn, t))
        if target.dtype != qs.dtype and target.dtype.is_floating_point:
            qs.dtype = target.dtype
        return self

    @torch.no_grad()
    def forward(self, quantized_param: torch.Tensor) -> torch.Tensor:
        # The packed bytes can also move without ``_apply`` (accelerate's per-tensor placement,
        # ``load_state_dict(assign=True)``): the state follows them before the kernel reads any pointer.
        # Host-side device attributes only, no sync.
        device = quantized_param.device
        if any(t.device != device for t in state_tensors(self.quant_state).values()):
            self.quant_state.to(device)
        return bnbf.dequantize_4bit(quantized_param, self.quant_state)


def install(module: torch.nn.Module, name: str) -> FollowingParametrization:
    """Swap bitsandbytes' parametrization of ``module.name`` for a :class:`FollowingParametrization` (same state)."""
    plist = module.parametrizations[name]
    following = FollowingParametrization(plist[0].quant_state)
    plist[0] = following
    return following


def load_state(current: bnbf.QuantState, items: dict[str, Any], assign: bool) -> None:
    """Load a saved quantization state (bitsandbytes' ``as_dict(packed=True)`` keys) into ``current``: in place
    (devices and tensor identities kept) unless ``assign``. The dequantized dtype stays the module's, as
    ``load_state_dict`` keeps a float parameter's dtype."""
    first = next(iter(items.values()))
    loaded = bnbf.QuantState.from_dict(dict(items), device=first.device)
    settings = ("quant_type", "blocksize", "nested")
    ours, theirs = (tuple(getattr(qs, k) for k in settings) + (tuple(qs.shape),) for qs in (current, loaded))
    if ours != theirs:
        raise ValueError(
            f"saved with (quant_type, blocksize, double quantization, shape) = {theirs}, but this model was "
            f"quantized with {ours}: quantize_experts_4bit with the settings of the checkpoint"
        )
    new = state_tensors(loaded)
    for name, t in state_tensors(current).items():
        source = new[name]
        if assign:
            _set_state_tensor(current, name, source)
        elif t.shape != source.shape:
            raise ValueError(f"quantization state {name} has shape {tuple(source.shape)}, expected {tuple(t.shape)}")
        else:
            with torch.no_grad():
                t.copy_(source)
