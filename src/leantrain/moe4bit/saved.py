"""What ``save_model()`` writes for what moe4bit changed, and the state-dict hooks that keep it so.

moe4bit changes no saved value. It re-homes tensors into shared buffers (each per-expert ``Linear4bit``'s packed
bytes and absmax in one stack per projection; each per-expert LoRA factor in one ``[E, ...]`` stack), which
safetensors and ``save_pretrained`` refuse as shared storage: :func:`clone_shared_on_save` hands out private copies
in the state dict. ``quantize_experts_4bit`` stacks save in bitsandbytes' packed form; :func:`load_pre_hook` reads it
back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._stacks import Record


DECLARATION = (
    "unchanged keys and values: quantize_experts_4bit's stacks save packed with their quantization state "
    "(load_state_dict into a model quantized the same way); per-expert Linear4bit weights and per-expert LoRA "
    "factors the grouped path consolidates stay each expert's own parameter (views of one buffer, copied out on "
    "save); expert LoRA adapters save with PEFT's save_pretrained"
)


def clone_shared_on_save(module: nn.Module, buffers: list[torch.Tensor], record: Record) -> None:
    """Tensors of ``module``'s state dict that live in one of ``buffers`` are handed out as private copies (loading
    still copies into the shared buffers); the hook's removal goes to ``record``."""
    shared = {t.untyped_storage().data_ptr() for t in buffers}

    def hook(mod: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for key, value in list(state_dict.items()):
            if key.startswith(prefix) and isinstance(value, torch.Tensor):
                if value.untyped_storage().data_ptr() in shared:
                    state_dict[key] = value.detach().clone()

    record(module.register_state_dict_post_hook(hook).remove)


def load_pre_hook(
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Map bitsandbytes' saved form (``{name}`` packed bytes + ``{name}.absmax`` / ``.quant_map`` / nested keys /
    ``.quant_state.bitsandbytes__*``) back onto the parametrization (``parametrizations.{name}.original``) and load
    the quantization state, for every stack this hook's module quantized (``quantize_experts_4bit`` registers it)."""
    from . import _qstate  # bitsandbytes: imported only once a quantized model loads

    for name, plist in module.parametrizations.items():
        key = prefix + name
        if not isinstance(plist[0], _qstate.FollowingParametrization) or key not in state_dict:
            continue  # a state dict in the module's own layout loads as usual
        packed = state_dict.pop(key)
        items = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(key + ".")]}
        if not isinstance(packed, torch.Tensor) or packed.dtype != plist.original.dtype:
            got = type(packed).__name__
            if isinstance(packed, torch.Tensor):
                got = f"{packed.dtype} {tuple(packed.shape)}"
            error_msgs.append(
                f"{key}: expected packed 4-bit data ({plist.original.dtype}), got {got}: load unquantized weights "
                "before leantrain.quantize_experts_4bit"
            )
            continue
        state_dict[f"{prefix}parametrizations.{name}.original"] = packed
        if not items:
            error_msgs.append(f"{key}: the checkpoint holds packed 4-bit data but no quantization state (absmax)")
            continue
        try:
            _qstate.load_state(plist[0].quant_state, items, bool(local_metadata.get("assign", False)))
        except (ValueError, AssertionError, KeyError) as error:
            error_msgs.append(f"{key}: {error}")
